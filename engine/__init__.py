"""intone's inference engine: the Pocket TTS model, one-request generation, the batched engine."""

from intone.engine.engine import (
    AudioChunk,
    ClauseDone,
    Engine,
    EngineConfig,
    EngineError,
    EngineFullError,
    Stream,
)
from intone.engine.generate import GenerationOptions
from intone.engine.loading import LoadedModel, ModelUnavailableError, load_model

__all__ = [
    "AudioChunk",
    "ClauseDone",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineFullError",
    "GenerationOptions",
    "LoadedModel",
    "ModelUnavailableError",
    "Stream",
    "load_model",
]

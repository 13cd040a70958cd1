"""intone's inference engine: the Pocket TTS model, one-request generation, the batched engine."""

from intone.engine.engine import Engine, EngineConfig
from intone.engine.errors import EngineError, EngineFullError
from intone.engine.generate import GenerationOptions
from intone.engine.loading import LoadedModel, ModelUnavailableError, load_model
from intone.engine.stream import AudioChunk, ClauseDone, Stream

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

"""intone's inference engine: the Pocket TTS model, one-request generation, the batched engine."""

from intone.engine.engine import Engine, EngineConfig
from intone.engine.errors import (
    EmptyTextError,
    EngineClosedError,
    EngineError,
    EngineFailedError,
    EngineFullError,
    IdleTimeoutError,
    InvalidOptionError,
    StreamClosedError,
    TextTooLongError,
    UnknownModelError,
    UnknownVoiceError,
)
from intone.engine.loading import LoadedModel, ModelUnavailableError, load_model
from intone.engine.options import GenerationOptions
from intone.engine.stream import AudioChunk, ClauseDone, Stream

__all__ = [
    "AudioChunk",
    "ClauseDone",
    "EmptyTextError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineError",
    "EngineFailedError",
    "EngineFullError",
    "GenerationOptions",
    "IdleTimeoutError",
    "InvalidOptionError",
    "LoadedModel",
    "ModelUnavailableError",
    "Stream",
    "StreamClosedError",
    "TextTooLongError",
    "UnknownModelError",
    "UnknownVoiceError",
    "load_model",
]

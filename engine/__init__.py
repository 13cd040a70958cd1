"""intone's inference engine: the Pocket TTS model, one-request generation, the batched engine.

Names are imported on first use, so that `intone.engine.errors` and `intone.engine.options`
(standard library only) can be used by the protocol module and the client without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from intone.engine.cpu_memory import request_huge_pages

request_huge_pages()  # before anything here imports torch

_EXPORTS = {
    "AudioChunk": "intone.engine.events",
    "ClauseDone": "intone.engine.events",
    "EmptyTextError": "intone.engine.errors",
    "Engine": "intone.engine.engine",
    "EngineClosedError": "intone.engine.errors",
    "EngineConfig": "intone.engine.config",
    "EngineError": "intone.engine.errors",
    "EngineFailedError": "intone.engine.errors",
    "EngineFullError": "intone.engine.errors",
    "GenerationOptions": "intone.engine.options",
    "Health": "intone.engine.engine",
    "IdleTimeoutError": "intone.engine.errors",
    "InvalidOptionError": "intone.engine.errors",
    "InvalidTextError": "intone.engine.errors",
    "LoadedModel": "intone.engine.loading",
    "ModelUnavailableError": "intone.engine.loading",
    "Stream": "intone.engine.stream",
    "StreamClosedError": "intone.engine.errors",
    "TextTooLongError": "intone.engine.errors",
    "UnknownModelError": "intone.engine.errors",
    "UnknownVoiceError": "intone.engine.errors",
    "load_model": "intone.engine.loading",
}

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
    "Health",
    "IdleTimeoutError",
    "InvalidOptionError",
    "InvalidTextError",
    "LoadedModel",
    "ModelUnavailableError",
    "Stream",
    "StreamClosedError",
    "TextTooLongError",
    "UnknownModelError",
    "UnknownVoiceError",
    "load_model",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from intone.engine.config import EngineConfig
    from intone.engine.engine import Engine, Health
    from intone.engine.errors import (
        EmptyTextError,
        EngineClosedError,
        EngineError,
        EngineFailedError,
        EngineFullError,
        IdleTimeoutError,
        InvalidOptionError,
        InvalidTextError,
        StreamClosedError,
        TextTooLongError,
        UnknownModelError,
        UnknownVoiceError,
    )
    from intone.engine.events import AudioChunk, ClauseDone
    from intone.engine.loading import LoadedModel, ModelUnavailableError, load_model
    from intone.engine.options import GenerationOptions
    from intone.engine.stream import Stream

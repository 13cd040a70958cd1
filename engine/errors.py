"""Errors the engine raises to its callers, one type per cause.

Every error is an `EngineError` with a stable `code`: providers and the server map errors by type
(or by `code` on the wire), never by message text. `retryable` says whether the same request may
succeed later or on another worker.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base of every engine error."""

    code = "engine_error"
    retryable = False


class InvalidOptionError(EngineError, ValueError):
    """A generation option or request parameter is out of range or of the wrong type."""

    code = "invalid_option"


class UnknownVoiceError(EngineError, ValueError):
    """The voice is not registered with this engine."""

    code = "unknown_voice"


class UnknownModelError(EngineError, ValueError):
    """The model asked for is not one this server or process serves; the message lists them."""

    code = "unknown_model"


class EmptyTextError(EngineError, ValueError):
    """A request ended without any speakable text."""

    code = "empty_text"


class InvalidTextError(EngineError, ValueError):
    """Text that is not valid Unicode: a lone surrogate (half of a UTF-16 pair), which no
    tokenizer can encode."""

    code = "bad_text"


class TextTooLongError(EngineError, ValueError):
    """A request's text is over the engine's limit (in total or for one clause)."""

    code = "text_too_long"


class StreamClosedError(EngineError):
    """Input pushed to a stream that was ended, cancelled or failed."""

    code = "stream_closed"


class EngineFullError(EngineError):
    """No room for another stream right now: retry later or on another worker."""

    code = "engine_full"
    retryable = True


class EngineClosedError(EngineError):
    """The engine is closed, closing or not started."""

    code = "engine_closed"


class EngineFailedError(EngineError):
    """Generation failed inside the engine (a bug or a device fault); `__cause__` has the cause."""

    code = "engine_failed"


class IdleTimeoutError(EngineError):
    """The stream had no text and no audio pending for longer than the engine's idle timeout."""

    code = "idle_timeout"

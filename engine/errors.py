"""Errors the engine raises to its callers, one type per cause, and the one error vocabulary.

Every error is an `EngineError` with a stable `code` (the same string the server sends on the
wire, `intone.provider.protocol.ErrorCode`) and a `kind`: what the failure means to whoever
retries. Providers and the server map errors by type, or by `code` once it crossed the wire,
never by message text.
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    """Why a request failed, as far as whoever retries it cares."""

    BAD_REQUEST = "bad_request"  # the settings are wrong (voice, options): fix them, not retry
    BAD_INPUT = "bad_input"  # this turn's text was refused; the next turn is unaffected
    BUSY = "busy"  # no room now: retry shortly, or elsewhere
    CONNECTION = "connection"  # the engine or the server could not be reached or went away
    SERVER = "server"  # generation failed inside the engine or the server
    AUTH = "auth"  # the server refused the credentials or the origin
    UNKNOWN = "unknown"


class EngineError(RuntimeError):
    """Base of every engine error."""

    code = "engine_error"
    kind = Kind.SERVER


class InvalidOptionError(EngineError, ValueError):
    """A generation option or request parameter is out of range or of the wrong type."""

    code = "bad_options"
    kind = Kind.BAD_REQUEST


class UnknownVoiceError(EngineError, ValueError):
    """The voice is not registered with this engine."""

    code = "unknown_voice"
    kind = Kind.BAD_REQUEST


class UnknownModelError(EngineError, ValueError):
    """The model asked for is not one this server or process serves; the message lists them."""

    code = "unknown_model"
    kind = Kind.BAD_REQUEST


class EmptyTextError(EngineError, ValueError):
    """A request ended without any speakable text."""

    code = "empty_text"
    kind = Kind.BAD_INPUT


class InvalidTextError(EngineError, ValueError):
    """Text that is not valid Unicode: a lone surrogate (half of a UTF-16 pair), which no
    tokenizer can encode."""

    code = "bad_text"
    kind = Kind.BAD_INPUT


class TextTooLongError(EngineError, ValueError):
    """A request's text is over the engine's limit (in total or for one clause)."""

    code = "text_too_long"
    kind = Kind.BAD_INPUT


class StreamClosedError(EngineError):
    """Input pushed to a stream that was ended, cancelled or failed."""

    code = "stream_closed"
    kind = Kind.BAD_INPUT


class EngineFullError(EngineError):
    """No room for another stream right now: retry later or on another worker."""

    code = "server_busy"
    kind = Kind.BUSY


class EngineClosedError(EngineError):
    """The engine is closed, closing or not started."""

    code = "shutting_down"
    kind = Kind.CONNECTION


class EngineFailedError(EngineError):
    """Generation failed inside the engine (a bug or a device fault); `__cause__` has the cause."""

    code = "engine_error"
    kind = Kind.SERVER


class IdleTimeoutError(EngineError):
    """The stream had no text and no audio pending for longer than the engine's idle timeout."""

    code = "idle_timeout"
    kind = Kind.BAD_INPUT


def engine_errors() -> list[type[EngineError]]:
    """Every engine error type, the base last."""
    found, todo = [], [EngineError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found[1:] + found[:1]

"""What a failure means to a provider: one reading of the engine's typed errors and the
server's error codes, so that in-process and remote failures are reported alike.

Every engine error has a stable `code` (`intone.engine.errors`), and the server sends its own
codes (`intone.provider.server.protocol.ErrorCode`) which the client raises as `IntoneError`.
`error_code` gives either as a string; the plugins map codes, never messages, onto their
framework's error kinds.
"""

from __future__ import annotations

from enum import Enum

from intone.engine.errors import EngineError


class Kind(Enum):
    """Why a request failed, as far as whoever retries it cares."""

    BAD_REQUEST = "bad_request"  # the settings are wrong (voice, options): fix them, not retry
    BAD_INPUT = "bad_input"  # this turn's text was refused; the next turn is unaffected
    BUSY = "busy"  # no room now: retry shortly, or elsewhere
    CONNECTION = "connection"  # the engine or the server could not be reached or went away
    SERVER = "server"  # generation failed inside the engine or the server
    AUTH = "auth"  # the server refused the credentials or the origin
    UNKNOWN = "unknown"


_KINDS: dict[str, Kind] = {
    # engine codes
    "invalid_option": Kind.BAD_REQUEST,
    "unknown_voice": Kind.BAD_REQUEST,
    "unknown_model": Kind.BAD_REQUEST,
    "empty_text": Kind.BAD_INPUT,
    "text_too_long": Kind.BAD_INPUT,
    "stream_closed": Kind.BAD_INPUT,
    "idle_timeout": Kind.BAD_INPUT,
    "engine_full": Kind.BUSY,
    "engine_closed": Kind.CONNECTION,
    "engine_failed": Kind.SERVER,
    "engine_error": Kind.SERVER,
    # server codes (the engine's, as the protocol names them, and the server's own)
    "bad_options": Kind.BAD_REQUEST,
    "bad_sample_rate": Kind.BAD_REQUEST,
    "bad_format": Kind.BAD_REQUEST,
    "bad_message": Kind.BAD_REQUEST,
    "unknown_type": Kind.BAD_REQUEST,
    "bad_text": Kind.BAD_INPUT,
    "stream_timeout": Kind.BAD_INPUT,
    "server_busy": Kind.BUSY,
    "too_many_streams": Kind.BUSY,
    "too_many_connections": Kind.BUSY,
    "rate_limited": Kind.BUSY,
    "shutting_down": Kind.CONNECTION,
    "connection_closed": Kind.CONNECTION,
    "slow_client": Kind.CONNECTION,
    "timeout": Kind.CONNECTION,  # the client's own: the server did not answer in time
    "internal_error": Kind.SERVER,
    "bad_upload": Kind.BAD_REQUEST,
    "bad_audio": Kind.BAD_REQUEST,
    "bad_voice_state": Kind.BAD_REQUEST,
    "voice_too_large": Kind.BAD_REQUEST,
    "voice_too_long": Kind.BAD_REQUEST,
    "voice_too_short": Kind.BAD_REQUEST,
    "voice_silent": Kind.BAD_REQUEST,
    "voice_cloning_unavailable": Kind.BAD_REQUEST,
    "too_many_voices": Kind.BAD_REQUEST,
    "voice_read_only": Kind.BAD_REQUEST,
    "unauthorized": Kind.AUTH,
    "origin_not_allowed": Kind.AUTH,
}


class VoiceRefusedError(ValueError):
    """A voice file that cannot be used (not audio, truncated, silent, too short or long, a
    voice state of another model...); `code` is the protocol's code, `status` the HTTP one."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


def error_code(e: BaseException) -> str | None:
    """The engine's or the server's code for `e`; None for anything else."""
    from intone.provider.client import IntoneError

    if isinstance(e, EngineError | IntoneError | VoiceRefusedError):
        return e.code
    return None


def error_kind(e: BaseException) -> Kind:
    code = error_code(e)
    if code is not None:
        return _KINDS.get(code, Kind.SERVER if isinstance(e, EngineError) else Kind.UNKNOWN)
    if isinstance(e, ConnectionError | TimeoutError | OSError):
        return Kind.CONNECTION
    if isinstance(e, ValueError):
        return Kind.BAD_INPUT  # an untyped refusal of the input
    return Kind.UNKNOWN


def is_busy(e: BaseException) -> bool:
    return error_kind(e) is Kind.BUSY

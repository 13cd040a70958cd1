"""What a failure means to a provider: the engine's typed errors and the server's codes read
alike, so that in-process and remote failures are reported alike.

Every engine error, every `IntoneError` the client raises and every refused voice upload
carries its wire `code` and its `kind` (`intone.engine.errors.Kind`); the plugins map kinds,
never messages, onto their framework's error kinds.
"""

from __future__ import annotations

from intone.engine.errors import EngineError, Kind
from intone.provider.client import IntoneError
from intone.provider.protocol import code_kind


class VoiceRefusedError(ValueError):
    """A voice file that cannot be used (not audio, truncated, silent, too short or long, a
    voice state of another model...); `code` is the protocol's code, `status` the HTTP one."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code = code
        self.kind = code_kind(code)
        self.message = message
        self.status = status


def error_code(e: BaseException) -> str | None:
    """The engine's or the server's code for `e`; None for anything else."""
    if isinstance(e, EngineError | IntoneError | VoiceRefusedError):
        return e.code
    return None


def error_kind(e: BaseException) -> Kind:
    if isinstance(e, EngineError | IntoneError | VoiceRefusedError):
        return e.kind
    if isinstance(e, ConnectionError | TimeoutError | OSError):
        return Kind.CONNECTION
    if isinstance(e, ValueError):
        return Kind.BAD_INPUT  # an untyped refusal of the input
    return Kind.UNKNOWN


def is_busy(e: BaseException) -> bool:
    return error_kind(e) is Kind.BUSY

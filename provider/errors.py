"""What a failure means to a provider: the engine's typed errors and the server's codes read
alike, so that in-process and remote failures are reported alike.

Every engine error and every `IntoneError` the client raises carries its wire `code` and its
`kind` (`intone.engine.errors.Kind`); the plugins map kinds, never messages, onto their
framework's error kinds.
"""

from __future__ import annotations

from intone.engine.errors import EngineError, Kind
from intone.provider.client import IntoneError


def error_code(e: BaseException) -> str | None:
    """The engine's or the server's code for `e`; None for anything else."""
    if isinstance(e, EngineError | IntoneError):
        return e.code
    return None


def error_kind(e: BaseException) -> Kind:
    if isinstance(e, EngineError | IntoneError):
        return e.kind
    if isinstance(e, ConnectionError | TimeoutError | OSError):
        return Kind.CONNECTION
    if isinstance(e, ValueError):
        return Kind.BAD_INPUT  # an untyped refusal of the input
    return Kind.UNKNOWN


def is_busy(e: BaseException) -> bool:
    return error_kind(e) is Kind.BUSY

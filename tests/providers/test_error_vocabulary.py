"""One error vocabulary: each engine error type carries its wire code and kind, the server's own
codes have theirs in the protocol module, and both providers read a failure the same way
whichever side of the wire it came from."""

from __future__ import annotations

import pytest

from intone.engine.errors import (
    EngineError,
    EngineFailedError,
    EngineFullError,
    InvalidOptionError,
    Kind,
    engine_errors,
)
from intone.provider import protocol
from intone.provider.client import IntoneConnectionError, IntoneError, IntoneTimeoutError
from intone.provider.errors import error_code, error_kind, is_busy
from intone.provider.protocol import ErrorCode


def test_every_engine_error_code_is_a_wire_code() -> None:
    for error in engine_errors():
        assert error.code in set(ErrorCode), f"{error.__name__}.code {error.code!r}"
        assert isinstance(error.kind, Kind), error.__name__


def test_every_wire_code_has_one_kind() -> None:
    for code in ErrorCode:
        assert protocol.code_kind(code) is not Kind.UNKNOWN, code
    engine_codes = {error.code for error in engine_errors()}
    # A code both sides use means the same to a caller from either side.
    for code in engine_codes:
        kinds = {error.kind for error in engine_errors() if error.code == code}
        assert len(kinds) == 1, (code, kinds)


@pytest.mark.parametrize("error", [cls("x") for cls in engine_errors()])
def test_an_engine_error_reads_the_same_in_process_and_over_the_wire(error: EngineError) -> None:
    wire = protocol.engine_error_code(error)
    remote = IntoneError(wire, "x")
    assert error_code(error) == error_code(remote) == wire
    assert error_kind(error) is error_kind(remote) is error.kind


def test_kinds_of_typical_failures() -> None:
    assert is_busy(EngineFullError("full")) and is_busy(IntoneError("rate_limited", "x"))
    assert error_kind(InvalidOptionError("bad")) is Kind.BAD_REQUEST
    assert error_kind(EngineFailedError("boom")) is Kind.SERVER
    assert error_kind(IntoneConnectionError("gone")) is Kind.CONNECTION
    assert error_kind(IntoneTimeoutError("slow")) is Kind.CONNECTION
    assert error_kind(IntoneError("a_code_from_a_newer_server", "x")) is Kind.UNKNOWN
    assert protocol.engine_error_code(ValueError("untyped refusal")) is ErrorCode.BAD_TEXT
    assert protocol.engine_error_code(RuntimeError("?")) is ErrorCode.ENGINE_ERROR

"""Limits per server and per caller (an API key, or the client address without keys).

The server holds at most `max_connections` connections (WebSockets and speech requests in
flight); each caller at most `max_streams_per_client` streams at once and
`max_chars_per_minute` characters of text (a token bucket: the full minute's allowance may come
at once, then it refills steadily). Each refusal says how long to wait (`retry_after`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from intone.provider.protocol import ErrorCode
from intone.provider.server.settings import ServerSettings


class LimitError(Exception):
    def __init__(self, code: ErrorCode, message: str, retry_after: float | None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


@dataclass
class _Caller:
    streams: int = 0
    chars: float = 0.0  # left in the bucket
    refilled_at: float = field(default_factory=lambda: time.monotonic())


class Limits:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.connections = 0
        self._callers: dict[str, _Caller] = {}

    # ---- connections

    def open_connection(self) -> None:
        limit = self.settings.max_connections
        if limit and self.connections >= limit:
            raise LimitError(
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"the server is at its limit of {limit} connections: retry later",
                retry_after=1.0,
            )
        self.connections += 1

    def close_connection(self) -> None:
        self.connections -= 1

    # ---- per caller

    def _caller(self, tenant: str) -> _Caller:
        caller = self._callers.get(tenant)
        if caller is None:
            caller = self._callers[tenant] = _Caller(chars=self.settings.max_chars_per_minute)
        return caller

    def open_stream(self, tenant: str) -> None:
        limit = self.settings.max_streams_per_client
        caller = self._caller(tenant)
        if limit and caller.streams >= limit:
            raise LimitError(
                ErrorCode.RATE_LIMITED,
                f"{limit} streams already open for this client: end one first",
                retry_after=1.0,
            )
        caller.streams += 1

    def close_stream(self, tenant: str) -> None:
        caller = self._callers.get(tenant)
        if caller is not None:
            caller.streams -= 1
            self._forget_if_idle(tenant, caller)

    def take_chars(self, tenant: str, count: int) -> None:
        """Spend `count` characters of the caller's minute, or refuse them all."""
        per_minute = self.settings.max_chars_per_minute
        if not per_minute:
            return
        if count > per_minute:  # no wait would make it fit
            raise LimitError(
                ErrorCode.RATE_LIMITED,
                f"{count} characters at once are over the limit of {per_minute} per minute: "
                "send the text in smaller pieces",
                retry_after=None,
            )
        caller = self._caller(tenant)
        self._refill(caller, per_minute)
        if count > caller.chars:
            rate = per_minute / 60.0
            wait = (count - caller.chars) / rate
            raise LimitError(
                ErrorCode.RATE_LIMITED,
                f"over {per_minute} characters per minute for this client: this text was "
                "dropped, send it again later",
                retry_after=round(max(wait, 0.1), 1),
            )
        caller.chars -= count

    def _refill(self, caller: _Caller, per_minute: int) -> None:
        now = time.monotonic()
        caller.chars = min(per_minute, caller.chars + (now - caller.refilled_at) * per_minute / 60)
        caller.refilled_at = now

    def _forget_if_idle(self, tenant: str, caller: _Caller) -> None:
        """Drop callers with nothing open and a full bucket: their state is the default, and
        the table must not grow with every address that ever connected."""
        if caller.streams > 0:
            return
        per_minute = self.settings.max_chars_per_minute
        if per_minute:
            self._refill(caller, per_minute)
            if caller.chars < per_minute:
                return
        del self._callers[tenant]

    def prune(self) -> None:
        for tenant, caller in list(self._callers.items()):
            self._forget_if_idle(tenant, caller)

    def tenants(self) -> int:
        """Callers with state held (something open, or characters spent recently)."""
        return len(self._callers)

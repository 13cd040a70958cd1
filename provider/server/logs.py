"""Structured logs: request-scoped fields (request_id, stream, connection) on every record.

`bind(logger, request_id=...)` returns a LoggerAdapter that adds the fields as `extra`;
`configure_logging(json_lines=...)` installs a formatter that prints them, as key=value pairs
after the message or as one JSON object per line. Both escape control characters in messages
and fields, so a client's newline cannot forge a log line. `ClientErrorLog` caps how many
client mistakes reach the log, so a client repeating one cannot fill the disk.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import MutableMapping
from typing import Any

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
_STANDARD.add("color_message")  # uvicorn's ANSI-coloured copy of the message


class ContextAdapter(logging.LoggerAdapter):
    """Adds fixed fields to every record, merged with any per-call `extra`."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs

    def bind(self, **fields: Any) -> ContextAdapter:
        return ContextAdapter(self.logger, {**(self.extra or {}), **fields})


def bind(logger: logging.Logger | ContextAdapter, **fields: Any) -> ContextAdapter:
    if isinstance(logger, ContextAdapter):
        return logger.bind(**fields)
    return ContextAdapter(logger, fields)


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


# C0 and C1 controls, DEL, line/paragraph separators and lone surrogates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def escape_controls(text: str) -> str:
    """`text` with every control character written as a Python escape (`\\n`, `\\x1b`)."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


class ClientErrorLog:
    """A token bucket for log lines about client mistakes: `burst` at once, then `per_second`;
    the lines it drops are counted and reported with the next one it lets through."""

    def __init__(self, per_second: float = 5.0, burst: int = 20):
        self.per_second = per_second
        self.burst = burst
        self._tokens = float(burst)
        self._at = time.monotonic()
        self.suppressed = 0

    def allow(self) -> int | None:
        """None: drop this line; else the number of lines dropped since the last one."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.per_second)
        self._at = now
        if self._tokens < 1:
            self.suppressed += 1
            return None
        self._tokens -= 1
        dropped, self.suppressed = self.suppressed, 0
        return dropped


class KeyValueFormatter(logging.Formatter):
    """`LEVEL logger: message key=value ...` for consoles."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        message = f"{record.levelname} {record.name}: {escape_controls(record.getMessage())}"
        fields = record_fields(record)
        if fields:
            message += " " + " ".join(f"{k}={escape_controls(str(v))}" for k, v in fields.items())
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return message


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, the extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(record_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class ClientMistakeFilter(logging.Filter):
    """Holds uvicorn's lines about client mistakes (4xx access lines, its warnings about
    malformed requests) to the client-error budget."""

    def __init__(self, budget: ClientErrorLog):
        super().__init__()
        self.budget = budget

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.access":
            args = record.args if isinstance(record.args, tuple) else ()
            status = args[-1] if args else None
            mistake = isinstance(status, int) and 400 <= status < 500
        else:
            mistake = record.name == "uvicorn.error" and record.levelno == logging.WARNING
        if not mistake:
            return True
        dropped = self.budget.allow()
        if dropped:
            record.suppressed = dropped
        return dropped is not None


def configure_logging(level: int = logging.INFO, json_lines: bool = False) -> None:
    """Root logging for `intone serve`; uvicorn's loggers propagate to it."""
    handler = logging.StreamHandler()
    handler.addFilter(ClientMistakeFilter(ClientErrorLog()))
    handler.setFormatter(JsonFormatter() if json_lines else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)

"""Structured logs: request-scoped fields (request_id, stream, connection) on every record.

`bind(logger, request_id=...)` returns a LoggerAdapter that adds the fields as `extra`;
`configure_logging(json_lines=...)` installs a formatter that prints them, as key=value pairs
after the message or as one JSON object per line.
"""

from __future__ import annotations

import json
import logging
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


class KeyValueFormatter(logging.Formatter):
    """`LEVEL logger: message key=value ...` for consoles."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = record_fields(record)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


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


def configure_logging(level: int = logging.INFO, json_lines: bool = False) -> None:
    """Root logging for `intone serve`; uvicorn's loggers propagate to it."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)

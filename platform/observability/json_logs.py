"""JSON log lines for the standard `logging`, each with the current request id.

`configure_logging("json")` makes every record one JSON object per line: time, level,
logger, message, request_id (when a request is being handled), the `extra=` fields a
call passed, and the formatted exception if any.
"""
from __future__ import annotations

import logging
import sys
from datetime import datetime, timezone
from typing import Literal

import orjson

from .request_id import current_request_id

LOG_FORMATS = ("text", "json")
# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or current_request_id()
        if rid is not None:
            entry["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """The text format, with ` request_id=...` appended while a request is handled."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None) or current_request_id()
        return line if rid is None else f"{line} request_id={rid}"


def configure_logging(fmt: Literal["text", "json"] = "text", level: int | str = logging.INFO,
                      stream=None) -> logging.Handler:
    """Replace the root logger's handlers with one writing `fmt` lines to `stream` (stderr)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler

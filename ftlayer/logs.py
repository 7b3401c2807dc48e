"""How `ftlayer serve` writes its log: text for people, or one JSON object per line for
log shippers (`--log-format json`).

A log call that concerns records passes their names as structured fields,
`log.warning(message, *args, extra=fields(source_id=..., partition=..., ...))`: the
source, the Kafka topic, partition and offsets, the roots (as 0x hex, the way
`ftlayer inspect --root` takes them), the storage seqs, counts and causes. The JSON
formatter writes them as keys of the line's object next to `time` (ISO 8601, UTC),
`level`, `logger` and `message` (and `exception`, a traceback's text); the text
formatter appends them to the message as `key=value`. A field never replaces one of
those five keys.

    {"time": "2025-01-31T12:00:00.123Z", "level": "WARNING", "logger": "ftlayer.core",
     "message": "trees timed out: queued for replay", "source_id": 7, "topic": "orders",
     "partition": 1, "count": 2, "offsets": [41, 57], "roots": ["0x8f...", "0x1c..."]}
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from collections.abc import Iterable
from itertools import islice
from typing import IO, Any, Final

from ftlayer.errors import ConfigError

__all__ = ["LOG_FORMATS", "JsonFormatter", "TextFormatter", "configure", "fields", "hex_ids"]

LOG_FORMATS: Final = ("text", "json")
FIELDS_ATTR: Final = "ftlayer_fields"
"""The LogRecord attribute that `fields()` sets (through `extra=`)."""
_RESERVED: Final = frozenset({"time", "level", "logger", "message", "exception"})
LISTED: Final = 20
"""At most this many offsets, roots or seqs are listed in one line's fields; `count`
says how many there were."""


def fields(**values: Any) -> dict[str, Any]:
    """The `extra=` of a log call that names what it concerns (module docstring)."""
    return {FIELDS_ATTR: values}


def hex_ids(ids: Iterable[int], limit: int = LISTED) -> list[str]:
    """Root ids as 0x hex (what `ftlayer inspect --root` takes), at most `limit`."""
    return [f"{int(value):#x}" for value in islice(ids, limit)]


def _fields_of(record: logging.LogRecord) -> dict[str, Any]:
    found = getattr(record, FIELDS_ATTR, None)
    return found if isinstance(found, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object per line (module docstring); values JSON cannot hold are written
    as their str()."""

    def format(self, record: logging.LogRecord) -> str:
        when = dt.datetime.fromtimestamp(record.created, dt.UTC)
        line: dict[str, Any] = {
            "time": when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _fields_of(record).items():
            if key not in _RESERVED:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`time logger message key=value ...` (the fields appended), then any traceback."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        extra = _fields_of(record)
        if not extra:
            return text
        shown = " ".join(f"{k}={_text(v)}" for k, v in extra.items())
        return f"{text} [{shown}]"


def _text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def configure(log_format: str = "text", stream: IO[str] | None = None) -> logging.Handler:
    """Send INFO and above of every logger to `stream` (stderr) in `log_format`; returns
    the handler. ConfigError for a format not in LOG_FORMATS."""
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler

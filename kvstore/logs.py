"""The daemon's log lines, in the format ``log_format`` names.

- ``text`` (the default), for people and the journal: ``TIME LEVEL LOGGER:
  MESSAGE`` then the record's fields as ``key=value``.
- ``json``, for log collectors: one object a line with ``time`` (ISO 8601,
  UTC), ``level``, ``logger`` and ``message``, then the record's fields, then
  ``exception`` (its traceback) and ``stack`` where the record has them.

A record's fields are what its call passed as ``extra=`` (``log.info("store
open at %s", path, extra={"segments": 3})``): every attribute a plain
:class:`logging.LogRecord` lacks, except private ones (a leading ``_``).
Values that JSON cannot hold are written as their ``str``.

:func:`setup` installs the one handler (stderr) on the root logger; the
daemon installs the secret scrubber (kvstore/redaction.py) on it right
after, which scrubs the fields too.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Final, TextIO

FORMATS: Final = ("text", "json")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every record has (and those Formatter.format adds): not fields.
_STANDARD: Final = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",  # Python 3.12's
}
_RESERVED: Final = ("time", "level", "logger", "message", "exception", "stack")


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of ``record`` (its ``extra=``), in the order given."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), default=str, ensure_ascii=False)


def text_value(value: object) -> str:
    """``value`` as the right side of ``key=value``: plain where that reads
    unambiguously, else as JSON (quoted strings, lists, objects)."""
    if isinstance(value, bool) or value is None:
        return _compact(value)
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        plain = value and not any(c.isspace() or c in "\"'=\\" for c in value)
        return value if plain else _compact(value)
    return _compact(value)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: MESSAGE key=value ...``, the traceback after."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = record_fields(record)
        if not fields:
            return line
        return line + " " + " ".join(f"{k}={text_value(v)}" for k, v in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object a line (module doc)."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        doc: dict[str, Any] = {
            "time": when.replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            doc[f"field_{key}" if key in _RESERVED else key] = value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            doc["exception"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return _compact(doc)


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return TextFormatter()
    raise ValueError(f"log_format={log_format!r}: expected one of {', '.join(FORMATS)}")


def setup(level: str, log_format: str, stream: TextIO | None = None) -> logging.Handler:
    """Log records of ``level`` and above to ``stream`` (stderr) in
    ``log_format``, through one handler on the root logger (returned)."""
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler

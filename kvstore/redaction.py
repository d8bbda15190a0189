"""No secret reaches a log: a scrubber applied to every log record.

Whatever logs it (kvstore, aiohttp's parser errors, asyncio, boto), a record's
message, its arguments, its exception text and traceback, its stack and its
structured fields (``extra=``, kvstore/logs.py: every string inside them)
are rewritten before any handler formats them:

- ``Authorization`` header values (``Authorization: …``, ``'Authorization': '…'``);
- anything after ``Bearer`` (a token with a typo is still a secret);
- ``token`` / ``secret`` / ``password`` / ``api_key`` fields (``"token": "…"``);
- tenant tokens (``kvs_`` + URL-safe base64, kvstore/engine/registry.py), anywhere;
- the literal secrets registered at start-up: the admin token, the master key
  (hex, base64, URL-safe base64, and the bytes' repr), AWS secret keys.

:func:`install` puts the scrubber on every handler of the root logger and into
the log record factory, so handlers added later, and loggers that do not
propagate, get scrubbed records too. A record's fields are set after the
factory runs: the filter on the root's handlers (the daemon's one handler,
kvstore/logs.py) scrubs those. Scrubbing is idempotent.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from kvstore.logs import record_fields

REDACTED = "[REDACTED]"
# Literal secrets shorter than this are not registered: replacing a short
# string everywhere would mangle ordinary words (and such a token is weak anyway).
MIN_SECRET_LEN = 8

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # Header values, in any rendering: raw, repr'd bytes, dicts, multidicts.
    (re.compile(r"""(?i)(\b(?:proxy-)?authorization\b['"]?\s*[:=]\s*['"]?)[^\r\n'"]*"""), r"\g<1>" + REDACTED),
    # "Bearer <x>", with the separator raw, repr-escaped (\t) or URL-encoded.
    (re.compile(r"""(?i)(\bbearer)(?:\s|\\[trnx]|%20|%09|\+)+[^\s'",;]+"""), r"\g<1> " + REDACTED),
    # JSON or query fields that hold a secret ("token_id" is not one: \b stops at "_").
    (
        re.compile(
            r"""(?i)(\b(?:token|secret|password|api[_-]?key|master[_-]?key)\b['"]?\s*[:=]\s*['"]?)[^\s'",;&}]+"""
        ),
        r"\g<1>" + REDACTED,
    ),
    # Tenant tokens anywhere (registry.TOKEN_PREFIX + secrets.token_urlsafe(32):
    # 43 characters), or a 16-character prefix of one (a truncated echo);
    # shorter runs are left alone (a path such as /srv/kvs_data is not a token).
    (re.compile(r"kvs_[A-Za-z0-9_\-]{16,}"), "kvs_" + REDACTED),
)
_PLAIN_FORMATTER = logging.Formatter()


class Scrubber(logging.Filter):
    """A :class:`logging.Filter` that redacts secrets in place and lets every
    record through. Thread-safe; literals can be added while it is in use."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._literals: tuple[str, ...] = ()

    def add_secret(self, text: str | None) -> None:
        """Redact ``text`` wherever it appears (ignored if shorter than MIN_SECRET_LEN)."""
        if not text or len(text) < MIN_SECRET_LEN:
            return
        with self._lock:
            if text not in self._literals:
                # Longest first, so a secret containing another is replaced whole.
                self._literals = tuple(sorted({*self._literals, text}, key=len, reverse=True))

    def add_key(self, secret: bytes) -> None:
        """Redact key bytes in every text form they could be logged in."""
        for text in (
            secret.hex(),
            secret.hex().upper(),
            base64.b64encode(secret).decode(),
            base64.b64encode(secret).decode().rstrip("="),
            base64.urlsafe_b64encode(secret).decode().rstrip("="),
            repr(secret)[2:-1],
        ):
            self.add_secret(text)

    def scrub(self, text: str) -> str:
        for literal in self._literals:
            if literal in text:
                text = text.replace(literal, REDACTED)
        for pattern, replacement in _PATTERNS:
            text = pattern.sub(replacement, text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_kvstore_scrubbed", False):
            self._scrub_text(record)
            record._kvstore_scrubbed = True
        # The fields (extra=) are set on a record after the record factory
        # ran: a handler's filter, later, scrubs them (idempotent).
        for key, value in record_fields(record).items():
            setattr(record, key, self._scrub_value(value))
        return True

    def _scrub_text(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not hide the record
            message = f"{record.msg!s} {record.args!r}"
        record.msg = self.scrub(message)
        record.args = None
        if record.exc_info and record.exc_info[0] is not None:
            text = record.exc_text or _PLAIN_FORMATTER.formatException(record.exc_info)
            record.exc_text = self.scrub(text)
            record.exc_info = None  # formatters print exc_text instead
        elif record.exc_text:
            record.exc_text = self.scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = self.scrub(record.stack_info)

    def _scrub_value(self, value: object) -> object:
        """A field's value with every string in it scrubbed; what is neither a
        number, a string nor a container of them becomes its scrubbed text."""
        if value is None or isinstance(value, bool | int | float):
            return value
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub(str(k)): self._scrub_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self._scrub_value(v) for v in value]
        return self.scrub(str(value))


SCRUBBER = Scrubber()


def install(scrubber: Scrubber = SCRUBBER, logger: logging.Logger | None = None) -> Scrubber:
    """Scrub every record from now on: a filter on each handler of ``logger``
    (the root logger by default) and a wrapper around the record factory, so
    records reach handlers added later already scrubbed. Also registers the
    AWS secrets of the environment. Idempotent."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if scrubber not in handler.filters:
            handler.addFilter(scrubber)
    factory = logging.getLogRecordFactory()
    if getattr(factory, "_kvstore_scrubber", None) is not scrubber:
        wrapped = _scrubbing_factory(factory, scrubber)
        logging.setLogRecordFactory(wrapped)
    for var in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        scrubber.add_secret(os.environ.get(var))
    return scrubber


def _scrubbing_factory(inner: Callable[..., logging.LogRecord], scrubber: Scrubber) -> Callable[..., logging.LogRecord]:
    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = inner(*args, **kwargs)
        scrubber.filter(record)
        return record

    factory._kvstore_scrubber = scrubber  # type: ignore[attr-defined]
    return factory

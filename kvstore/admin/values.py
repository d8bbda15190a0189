"""The values an admin command's flags take, read as a person writes them:
sizes (``10GiB``), durations (``90``, ``30m``, ``7d``), counts, and a word
(``none``, ``default``) for "no value": the daemon's null, which removes a
limit or puts a setting back to the store's default.

Each reader raises argparse's ArgumentTypeError saying what it expected;
the range of a value is the daemon's to check (its 400 names the field).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Final


class Null:
    """The daemon's null: "none" (no limit) or "default" (the store's)."""

    def __repr__(self) -> str:
        return "null"


NULL: Final = Null()
NULL_WORDS = frozenset({"none", "default", "null"})
_SIZE = re.compile(r"(\d+)\s*(|b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DURATION = re.compile(r"(\d+)\s*(|s|m|h|d)", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


SIZE = "a size in bytes such as 1073741824 or 10GiB"
SECONDS = "seconds such as 3600, 30m, 12h or 7d"
COUNT = "a whole number such as 2"


def size(text: str) -> int:
    """Bytes: ``1073741824``, ``512KiB``, ``10GiB`` (k, m, g, t are powers of 1024)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected {SIZE}; got {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)[:1].lower()]


def seconds(text: str) -> int:
    """Whole seconds: ``3600``, ``90s``, ``30m``, ``12h``, ``7d``."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected {SECONDS}; got {text!r}")
    return int(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def count(text: str) -> int:
    """A whole number, 0 or more."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected {COUNT}; got {text!r}")
    return int(text)


def or_null(read: Callable[[str], int], expected: str, word: str) -> Callable[[str], int | Null]:
    """``read`` (which takes ``expected``), or :data:`NULL` for ``word``
    (or any of :data:`NULL_WORDS`)."""

    def parse(text: str) -> int | Null:
        if text.strip().lower() in NULL_WORDS:
            return NULL
        try:
            return read(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected {expected}, or {word}; got {text!r}") from None

    return parse


def text_or_null(text: str) -> str | Null:
    """A string, or :data:`NULL` for ``default`` (or any of :data:`NULL_WORDS`)."""
    return NULL if text.strip().lower() in NULL_WORDS else text


def json_value(value: object) -> object:
    """A flag's value as the daemon's JSON takes it (:data:`NULL`: null)."""
    return None if isinstance(value, Null) else value

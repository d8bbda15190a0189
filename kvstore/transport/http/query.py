"""Query parameters (RFC 3986 §3.4), typed as docs/openapi.yaml describes them,
read strictly: a value of the wrong type, out of range, or a parameter given
twice is a 400 naming it, never silently read as something else (int()
and float() would take " 5", "+5", "5_0", Arabic-Indic digits, "1e3", "nan").
"""

from __future__ import annotations

import re

from aiohttp import web

from kvstore.errors import InvalidInput

_DECIMAL = re.compile(r"[0-9]{1,18}")
_NUMBER = re.compile(r"[0-9]{1,18}(\.[0-9]{1,9})?")
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")


def query_value(request: web.Request, name: str) -> str | None:
    """The query parameter ``name`` (None when absent); 400 if given twice."""
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise InvalidInput(f"query parameter {name!r} is given {len(values)} times; give it once")
    return values[0] if values else None


def query_int(request: web.Request, name: str, lo: int, hi: int) -> int | None:
    """An integer query parameter: decimal ASCII digits, from ``lo`` to
    ``hi``; None when absent."""
    raw = query_value(request, name)
    if raw is None:
        return None
    if not _DECIMAL.fullmatch(raw) or not lo <= int(raw) <= hi:
        raise InvalidInput(f"query parameter {name!r} must be an integer from {lo} to {hi}")
    return int(raw)


def query_number(request: web.Request, name: str, lo: float, hi: float, default: float) -> float:
    """A number query parameter: decimal ASCII digits with an optional
    fraction (``2``, ``0.5``), from ``lo`` to ``hi``."""
    raw = query_value(request, name)
    if raw is None:
        return default
    if not _NUMBER.fullmatch(raw) or not lo <= float(raw) <= hi:
        raise InvalidInput(f"query parameter {name!r} must be a number from {lo:g} to {hi:g}, such as 2 or 0.5")
    return float(raw)


def query_bool(request: web.Request, name: str, default: bool) -> bool:
    """A boolean query parameter: 1, true, yes or 0, false, no (any case)."""
    raw = query_value(request, name)
    if raw is None:
        return default
    if raw.lower() not in TRUE + FALSE:
        raise InvalidInput(f"query parameter {name!r} must be one of {', '.join(TRUE + FALSE)}")
    return raw.lower() in TRUE

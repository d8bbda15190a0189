"""How the admin command shows answers to a person: aligned tables, key and
value lines, and numbers in a person's units (1.5 GiB, 2h30m, 97.2%).
``--json`` bypasses all of it."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: Iterable[int] = ()) -> str:
    """Columns aligned under ``headers``: the ``numeric`` ones (by index) to
    the right, the others to the left; two spaces between columns."""
    lines = [list(headers), *(list(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    right = set(numeric)
    out = []
    for line in lines:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def pairs(rows: Sequence[tuple[str, str]]) -> str:
    """``name  value`` lines, the values aligned."""
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}".rstrip() for k, v in rows)


def size(n: int | float | None, none: str = "none") -> str:
    """Bytes in binary units (``none`` for None): 0 B, 512 B, 1.5 GiB."""
    if n is None:
        return none
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def duration(seconds: float | None, none: str = "none") -> str:
    """Seconds as days, hours, minutes and seconds (the two largest): 45s,
    1m30s, 2h, 3d4h."""
    if seconds is None:
        return none
    s = int(seconds)
    if s < 60:
        return f"{seconds:.0f}s" if seconds >= 1 or seconds == 0 else f"{seconds:.1f}s"
    parts = [(s // 86400, "d"), (s // 3600 % 24, "h"), (s // 60 % 60, "m"), (s % 60, "s")]
    first = next(i for i, (v, _) in enumerate(parts) if v)
    return "".join(f"{v}{u}" for v, u in parts[first : first + 2] if v)


def when(ns: int) -> str:
    """A time in nanoseconds since the epoch, in UTC to the second."""
    t = datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%SZ")


def ratio(hit: int, miss: int) -> str:
    """Hits of all asked, as a percentage ("-" when nothing was asked)."""
    total = hit + miss
    return f"{100 * hit / total:.1f}%" if total else "-"


def count(n: int) -> str:
    """A count with thousands separated: 1,234,567."""
    return f"{n:,}"

"""HTTP byte ranges (RFC 9110 §14) and If-None-Match (RFC 9110 §13.1.2) for block reads.

Pure functions, no I/O: the HTTP layer passes header values in and gets back
what to send.

Range handling (``GET /v1/blocks/...``):

- :func:`parse_range` returns ``None`` when the Range header is to be ignored
  (absent, another unit, invalid syntax, too many ranges): the server answers
  200 with the whole block, as RFC 9110 §14.2 allows ("A server MAY ignore the
  Range header field"; "MAY ignore or reject a Range header field that contains
  an invalid ranges-specifier").
- It raises :class:`kvstore.errors.InvalidRange` when the header is valid but no
  range overlaps the block: 416 with ``Content-Range: bytes */size``
  (RFC 9110 §14.2, §14.4, §15.5.17); :func:`unsatisfied_content_range` spells it.
- Otherwise it returns the satisfiable ranges in request order; for one range
  the server answers 206 with ``Content-Range`` from
  :meth:`ByteRange.content_range` (RFC 9110 §14.4, §15.3.7).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import InvalidRange

MAX_RANGES = 16
"""A Range header with more range-specs than this is ignored (RFC 9110 §14.2 lets a
server ignore a set of many small ranges; it is also a cheap DoS guard)."""

_OWS = " \t"  # RFC 9110 §5.6.3: OWS = *( SP / HTAB )
_DIGITS = frozenset("0123456789")  # RFC 5234 DIGIT: ASCII only (str.isdigit() is not)
# Numbers with more digits than this are larger than any block (sizes are < 2**63),
# so they are never converted with int(): that would be slow for thousands of
# digits, and Python refuses more than sys.get_int_max_str_digits() of them.
_MAX_DIGITS = 19
_HUGE: int = 10**_MAX_DIGITS


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``start`` (inclusive) to ``end`` (exclusive) of a block.

    Unlike the first-pos/last-pos of RFC 9110 §14.1.2, ``end`` is exclusive, as in
    Python slices: ``block[r.start:r.end]`` is the range's content.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"byte range [{self.start}, {self.end}) is empty or negative")

    @property
    def length(self) -> int:
        """Number of bytes in the range (the 206 response's Content-Length)."""
        return self.end - self.start

    def content_range(self, size: int) -> str:
        """The Content-Range value of a 206 for this range of a ``size``-byte block:
        ``bytes first-last/size`` (RFC 9110 §14.4, last inclusive)."""
        if self.end > size:
            raise ValueError(f"byte range [{self.start}, {self.end}) exceeds the block size {size}")
        return f"bytes {self.start}-{self.end - 1}/{size}"


def unsatisfied_content_range(size: int) -> str:
    """The Content-Range value of a 416 for a ``size``-byte block: ``bytes */size``
    (RFC 9110 §14.4, unsatisfied-range; §15.5.17)."""
    return f"bytes */{size}"


class _Malformed(Exception):
    """A range-spec that does not follow the grammar: the whole header is ignored."""


def _number(digits: str) -> int:
    """The value of a non-empty ASCII ``1*DIGIT`` string; raises _Malformed if it is not one.

    A value of more than ``_MAX_DIGITS`` significant digits comes back as
    ``_HUGE``, which is larger than any size; that is all the arithmetic needs
    (the order of two such values is checked with :func:`_greater`).
    """
    if not digits or not _DIGITS.issuperset(digits):
        raise _Malformed
    significant = digits.lstrip("0")
    if len(significant) > _MAX_DIGITS:
        return _HUGE
    return int(significant or "0")


def _greater(a: str, b: str) -> bool:
    """Whether the ASCII digit string ``a`` denotes a larger number than ``b``
    (exact for any length, without int())."""
    a, b = a.lstrip("0"), b.lstrip("0")
    return (len(a), a) > (len(b), b)


def _parse_spec(spec: str, size: int) -> ByteRange | None:
    """One range-spec (RFC 9110 §14.1.1, §14.1.2) against a ``size``-byte block.

    Returns the satisfiable range, or ``None`` if the spec is valid but
    unsatisfiable; raises _Malformed if it is invalid.
    """
    first_s, sep, last_s = spec.partition("-")
    if not sep:
        raise _Malformed
    if not first_s:
        # suffix-range = "-" suffix-length
        suffix = _number(last_s)
        if suffix == 0 or size == 0:
            # RFC 9110 §14.1.2: a suffix-range is satisfiable only with a non-zero
            # suffix-length. RFC 9110 also counts a non-zero suffix of a zero-length
            # representation as satisfiable, but no Content-Range can describe the
            # nothing it selects (§14.4): treated as unsatisfiable. Blocks are never
            # empty anyway.
            return None
        # "If the selected representation is shorter than the specified
        # suffix-length, the entire representation is used." (§14.1.2)
        return ByteRange(max(size - suffix, 0), size)
    # int-range = first-pos "-" [ last-pos ]
    first = _number(first_s)
    if last_s:
        last = _number(last_s)
        # "An int-range is invalid if the last-pos value is present and less than
        # the first-pos." (§14.1.1)
        if _greater(first_s, last_s):
            raise _Malformed
        end = min(last + 1, size)  # a last-pos beyond the end is clamped (§14.1.2)
    else:
        end = size
    if first >= size:
        # "an int-range is satisfiable if the first-pos is less than the current
        # length of the selected representation" (§14.1.2)
        return None
    return ByteRange(first, end)


def _specs(header: str) -> list[str]:
    """The range-specs of a ``bytes`` Range header (empty list elements
    dropped); none for another unit or no ``=``."""
    unit, eq, range_set = header.strip(_OWS).partition("=")
    if not eq or not unit.isascii() or unit.lower() != "bytes":
        return []
    return [spec for spec in (element.strip(_OWS) for element in range_set.split(",")) if spec]


def range_spec_count(header: str | None) -> int:
    """How many range-specs a Range header value names (0: none, another
    unit). A request for several ranges is answered with the whole block
    (200) however many of them the block satisfies: the answer's form
    depends on the request, not on the block's size."""
    return len(_specs(header)) if header is not None else 0


def parse_range(header: str | None, size: int) -> list[ByteRange] | None:
    """Parse a Range header value (RFC 9110 §14.2) against a block of ``size`` bytes.

    Grammar (RFC 9110 §14.1.1, §14.1.2; list syntax §5.6.1)::

        Range       = ranges-specifier
        ranges-specifier = range-unit "=" range-set
        range-set   = 1#range-spec          ; OWS around commas, empty elements ignored
        range-spec  = int-range / suffix-range
        int-range   = first-pos "-" [ last-pos ]
        suffix-range = "-" suffix-length

    Returns:

    - ``None`` (ignore the header, answer 200 with the whole block) when
      ``header`` is None, names a unit other than ``bytes`` (units compare
      case-insensitively, §14.1), is syntactically invalid (including
      ``first > last`` and whitespace inside a range-spec), has no range-spec, or
      has more than :data:`MAX_RANGES` range-specs (§14.2: a server MAY ignore an
      invalid ranges-specifier or many ranges);
    - otherwise the satisfiable ranges, in request order, not coalesced:
      ``last`` beyond the block is clamped, a suffix longer than the block selects
      the whole block, and unsatisfiable range-specs (``first >= size``,
      suffix ``-0``) are dropped.

    Leading and trailing whitespace of the value is not part of a field value
    (§5.5) and is ignored; whitespace is tolerated around every list element
    (so also right after ``=``), a little more than the grammar's OWS around
    commas.

    Raises :class:`kvstore.errors.InvalidRange` (416, with ``.size``) when the
    header is valid but no range-spec is satisfiable (§14.1.1, §15.5.17). With
    ``size == 0`` every range-spec is unsatisfiable.
    """
    if header is None:
        return None
    if not 0 <= size < _HUGE:
        raise ValueError(f"size must be 0 to 10**{_MAX_DIGITS} - 1, got {size}")
    specs = _specs(header)
    if not specs or len(specs) > MAX_RANGES:
        return None
    try:
        parsed = [_parse_spec(spec, size) for spec in specs]
    except _Malformed:
        return None
    ranges = [r for r in parsed if r is not None]
    if not ranges:
        # The header's value is not repeated: an error body never echoes a request's headers.
        raise InvalidRange(
            f"Range: no range overlaps the block of {size} bytes "
            f"(first byte must be below {size}, suffix length must be non-zero)",
            size,
        )
    return ranges


def _entity_tags(value: str) -> list[tuple[bool, str]] | None:
    """The entity-tags of a ``#entity-tag`` list (RFC 9110 §8.8.3, §5.6.1) as
    (weak, opaque-tag) pairs; None if the list is malformed.

    ``entity-tag = [ weak ] opaque-tag; weak = %s"W/"; opaque-tag = DQUOTE *etagc DQUOTE;
    etagc = %x21 / %x23-7E / obs-text``: an opaque-tag may contain commas, so the
    list is scanned, not split.
    """
    tags: list[tuple[bool, str]] = []
    i, n = 0, len(value)
    while True:
        while i < n and value[i] in _OWS + ",":  # OWS, separators and empty elements
            i += 1
        if i == n:
            return tags
        weak = value.startswith("W/", i)  # %s"W/": case-sensitive
        if weak:
            i += 2
        if i == n or value[i] != '"':
            return None
        close = value.find('"', i + 1)
        if close < 0:
            return None
        opaque = value[i : close + 1]
        if any(c < "\x21" or c == "\x7f" for c in opaque):
            return None
        tags.append((weak, opaque))
        i = close + 1
        while i < n and value[i] in _OWS:
            i += 1
        if i < n and value[i] != ",":
            return None


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an If-None-Match header value matches the current ``etag``
    (RFC 9110 §13.1.2): if it does, a GET or HEAD is answered 304 Not Modified.

    - ``None`` (no header) never matches;
    - ``*`` matches (the block exists: this is only asked about existing blocks);
    - otherwise the value is a comma-separated list of entity-tags, and it matches
      if any of them matches ``etag`` by weak comparison (§8.8.3.2: the
      opaque-tags are equal, ``W/`` prefixes ignored), so ``W/"x"`` matches ``"x"``.

    A malformed value matches nothing: the request proceeds unconditionally,
    which is always a correct answer.

    ``etag`` is the block's entity-tag as sent in the ETag header, quotes
    included (``"0123abcd..."``); anything else raises ValueError.
    """
    own = _entity_tags(etag)
    if own is None or len(own) != 1 or own[0][1] != etag.strip(_OWS).removeprefix("W/"):
        raise ValueError(f"etag must be one quoted entity-tag such as '\"abc\"', got {etag!r}")
    if if_none_match is None:
        return False
    value = if_none_match.strip(_OWS)
    if value == "*":
        return True
    tags = _entity_tags(value)
    if tags is None:
        return False
    return any(opaque == own[0][1] for _, opaque in tags)

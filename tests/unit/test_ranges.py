"""ranges.py: every Range form of RFC 9110 §14, checked against tables and a reference model;
If-None-Match matching (RFC 9110 §13.1.2)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import InvalidRange
from kvstore.transport.http.ranges import MAX_RANGES, ByteRange, etag_matches, parse_range, unsatisfied_content_range
from kvstore.transport.statuses import http_status

SIZE = 100


def spans(ranges: list[ByteRange] | None) -> list[tuple[int, int]] | None:
    return None if ranges is None else [(r.start, r.end) for r in ranges]


# -- ByteRange -------------------------------------------------------------------


def test_byte_range_length_and_content_range() -> None:
    r = ByteRange(10, 20)
    assert r.length == 10
    assert r.content_range(100) == "bytes 10-19/100"
    assert ByteRange(0, 1).content_range(1) == "bytes 0-0/1"
    assert ByteRange(99, 100).content_range(100) == "bytes 99-99/100"


def test_byte_range_slices_like_python() -> None:
    block = bytes(range(100))
    r = ByteRange(5, 9)
    assert block[r.start : r.end] == bytes([5, 6, 7, 8])
    assert len(block[r.start : r.end]) == r.length


@pytest.mark.parametrize(("start", "end"), [(5, 5), (6, 5), (-1, 3)])
def test_byte_range_rejects_empty_or_negative(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="empty or negative"):
        ByteRange(start, end)


def test_byte_range_content_range_past_size_is_an_error() -> None:
    with pytest.raises(ValueError, match="exceeds the block size 10"):
        ByteRange(5, 11).content_range(10)


def test_byte_range_is_frozen() -> None:
    r = ByteRange(0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.start = 3  # type: ignore[misc]
    assert r == ByteRange(0, 1)
    assert hash(r) == hash(ByteRange(0, 1))


def test_unsatisfied_content_range() -> None:
    assert unsatisfied_content_range(1234) == "bytes */1234"


# -- parse_range: tables ------------------------------------------------------------

VALID = [
    # first-last
    ("bytes=0-0", [(0, 1)]),
    ("bytes=0-99", [(0, 100)]),
    ("bytes=10-19", [(10, 20)]),
    ("bytes=99-99", [(99, 100)]),
    ("bytes=007-009", [(7, 10)]),
    # last beyond the end is clamped
    ("bytes=50-100", [(50, 100)]),
    ("bytes=50-1000", [(50, 100)]),
    ("bytes=0-" + "9" * 30, [(0, 100)]),
    ("bytes=0-" + "1" * 5000, [(0, 100)]),  # more digits than int() converts by default
    # first-
    ("bytes=0-", [(0, 100)]),
    ("bytes=99-", [(99, 100)]),
    # -suffix
    ("bytes=-1", [(99, 100)]),
    ("bytes=-10", [(90, 100)]),
    ("bytes=-100", [(0, 100)]),
    ("bytes=-101", [(0, 100)]),  # a suffix longer than the block is the whole block
    ("bytes=-" + "9" * 5000, [(0, 100)]),
    ("bytes=-0010", [(90, 100)]),
    # the unit is case-insensitive (RFC 9110 §14.1)
    ("Bytes=1-2", [(1, 3)]),
    ("BYTES=1-2", [(1, 3)]),
    # OWS around commas, empty list elements, whitespace around the value
    ("bytes=1-2,5-6", [(1, 3), (5, 7)]),
    ("bytes=1-2, 5-6", [(1, 3), (5, 7)]),
    ("bytes=1-2 ,5-6", [(1, 3), (5, 7)]),
    ("bytes=1-2 \t, \t5-6", [(1, 3), (5, 7)]),
    ("bytes=1-2,,5-6", [(1, 3), (5, 7)]),
    ("bytes=,1-2", [(1, 3)]),
    ("bytes=1-2,", [(1, 3)]),
    ("bytes= 1-2", [(1, 3)]),
    ("  bytes=1-2 \t", [(1, 3)]),
    # request order, no coalescing of overlapping or adjacent ranges
    ("bytes=50-59,0-9", [(50, 60), (0, 10)]),
    ("bytes=0-9,5-14,15-19", [(0, 10), (5, 15), (15, 20)]),
    ("bytes=-5,0-0", [(95, 100), (0, 1)]),
    # unsatisfiable range-specs are dropped when another one is satisfiable
    ("bytes=0-9,200-300", [(0, 10)]),
    ("bytes=100-,5-5", [(5, 6)]),
    ("bytes=-0,0-0", [(0, 1)]),
    ("bytes=" + "9" * 40 + "-,1-1", [(1, 2)]),
]


@pytest.mark.parametrize(("header", "expected"), VALID)
def test_valid_ranges(header: str, expected: list[tuple[int, int]]) -> None:
    assert spans(parse_range(header, SIZE)) == expected


INVALID = [
    "",
    "   ",
    "bytes",
    "bytes=",
    "bytes=,",
    "bytes= , ,",
    "=0-1",
    "bytes:0-1",
    "items=0-1",
    "bytesx=0-1",
    "bytes =0-1",
    "b ytes=0-1",
    "bytes=abc",
    "bytes=5-1",
    "bytes=1-0",
    "bytes=1-2-3",
    "bytes= -",
    "bytes=-",
    "bytes=--1",
    "bytes=-1-2",
    "bytes=1",
    "bytes=1-2;3-4",
    "bytes=0x1-2",
    "bytes=+1-2",
    "bytes=1--2",
    "bytes=-+5",
    "bytes=1 -2",
    "bytes=1- 2",
    "bytes=1.0-2",
    "bytes=\u0661-\u0662",  # Arabic-Indic digits: int() takes them, DIGIT does not
    "bytes=\u00b2-\u00b3",  # superscripts: str.isdigit() says yes
    "bytes=\uff11-\uff12",  # fullwidth digits
    "bytes=0-1,5-1",  # one invalid range-spec makes the header invalid
    "bytes=0-1,abc",
    "bytes=0-1,-",
    "bytes=" + "9" * 31 + "-" + "9" * 30,  # first > last, both beyond int64
    "bytes=" + "2" * 5000 + "-" + "1" * 5000,
    "bytes=10-" + "0" * 30 + "9",  # leading zeros do not make last larger
]


@pytest.mark.parametrize("header", INVALID)
def test_invalid_ranges_are_ignored(header: str) -> None:
    assert parse_range(header, SIZE) is None


def test_absent_header_is_ignored() -> None:
    assert parse_range(None, SIZE) is None


def test_at_most_sixteen_ranges() -> None:
    sixteen = "bytes=" + ",".join(f"{i}-{i}" for i in range(MAX_RANGES))
    assert MAX_RANGES == 16
    assert spans(parse_range(sixteen, SIZE)) == [(i, i + 1) for i in range(16)]
    assert parse_range(sixteen + ",16-16", SIZE) is None
    # empty list elements do not count
    assert spans(parse_range(sixteen + ",,, ,", SIZE)) == [(i, i + 1) for i in range(16)]
    # unsatisfiable ones do
    assert parse_range(sixteen + ",500-", SIZE) is None


UNSATISFIABLE = [
    ("bytes=100-", 100),
    ("bytes=100-100", 100),
    ("bytes=100-200", 100),
    ("bytes=1000-", 100),
    ("bytes=-0", 100),
    ("bytes=-000", 100),
    ("bytes=100-,-0,200-300", 100),
    ("bytes=" + "9" * 30 + "-", 100),
    ("bytes=" + "1" * 5000 + "-" + "2" * 5000, 100),
    ("bytes=1-1", 1),
    # a zero-length representation: nothing is satisfiable
    ("bytes=0-", 0),
    ("bytes=0-0", 0),
    ("bytes=-1", 0),
    ("bytes=-0", 0),
]


@pytest.mark.parametrize(("header", "size"), UNSATISFIABLE)
def test_unsatisfiable_ranges_raise_416(header: str, size: int) -> None:
    with pytest.raises(InvalidRange) as info:
        parse_range(header, size)
    err = info.value
    assert err.size == size
    assert http_status(err) == 416
    assert err.code == "range_not_satisfiable"
    assert f"block of {size} bytes" in str(err)


def test_unsatisfiable_message_does_not_echo_the_header() -> None:
    # Issue 24: an error body never repeats a request's header (the fuzz suite checks it).
    header = "bytes=" + ",".join(["1000-"] * 16)
    with pytest.raises(InvalidRange) as info:
        parse_range(header, SIZE)
    assert len(str(info.value)) < 200
    assert "1000-" not in str(info.value) and str(SIZE) in str(info.value)


def test_invalid_syntax_wins_over_unsatisfiable() -> None:
    # RFC 9110 §14.1.1: one invalid range-spec makes the ranges-specifier invalid.
    assert parse_range("bytes=1000-,abc", SIZE) is None


def test_one_byte_block() -> None:
    assert spans(parse_range("bytes=0-", 1)) == [(0, 1)]
    assert spans(parse_range("bytes=-5", 1)) == [(0, 1)]
    assert spans(parse_range("bytes=0-7", 1)) == [(0, 1)]


def test_negative_size_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="size"):
        parse_range("bytes=0-1", -1)


# -- parse_range: against a reference model -----------------------------------------

_REF_SPEC = re.compile(r"([0-9]+)-([0-9]*)|-([0-9]+)")


def reference(header: str, size: int) -> list[tuple[int, int]] | str | None:
    """A small independent reading of RFC 9110 §14.1-14.2: a list of (start, end),
    None for "ignore", "416" for unsatisfiable. For short numbers only."""
    m = re.fullmatch(r"[ \t]*([Bb][Yy][Tt][Ee][Ss])=(.*?)[ \t]*", header, re.DOTALL)
    if m is None:
        return None
    elements = [e for e in re.split(r"[ \t]*,[ \t]*", m.group(2).strip(" \t")) if e]
    if not elements or len(elements) > 16:
        return None
    out: list[tuple[int, int]] = []
    for e in elements:
        spec = _REF_SPEC.fullmatch(e)
        if spec is None:
            return None
        first, last, suffix = spec.groups()
        if suffix is not None:
            n = int(suffix)
            if n > 0 and size > 0:
                out.append((max(0, size - n), size))
        else:
            if last and int(last) < int(first):
                return None
            if int(first) < size:
                out.append((int(first), min(int(last) + 1, size) if last else size))
    return out or "416"


def outcome(header: str, size: int) -> list[tuple[int, int]] | str | None:
    try:
        return spans(parse_range(header, size))
    except InvalidRange as e:
        assert e.size == size
        return "416"


@st.composite
def range_headers(draw: st.DrawFn) -> str:
    """Range headers, mostly well-formed, some broken in one place."""
    num = st.integers(0, 300).map(str) | st.from_regex(r"0{1,3}[0-9]{1,3}", fullmatch=True)
    spec = st.one_of(
        st.tuples(num, num).map(lambda t: f"{t[0]}-{t[1]}"),
        num.map(lambda n: f"{n}-"),
        num.map(lambda n: f"-{n}"),
    )
    ows = st.sampled_from(["", " ", "\t", "  "])
    specs = draw(st.lists(spec, min_size=0, max_size=18))
    if draw(st.integers(0, 9)) == 0:
        bad = draw(st.sampled_from(["", "-", "x", "1-2-3", "--1", "1 -2", "\u0661-"]))
        specs.insert(draw(st.integers(0, len(specs))), bad)
    sep = "".join([draw(ows), ",", draw(ows)])
    unit = draw(st.sampled_from(["bytes", "Bytes", "BYTES", "bytes", "bytes", "items", "bytes "]))
    return f"{draw(ows)}{unit}={sep.join(specs)}{draw(ows)}"


@given(header=range_headers(), size=st.integers(0, 400))
def test_matches_the_reference_model(header: str, size: int) -> None:
    assert outcome(header, size) == reference(header, size)


@given(
    prefix=st.sampled_from(["bytes=", "Bytes=", " bytes=", "bytes", ""]),
    rest=st.text(alphabet="0123456789-, \t\u0661x=", max_size=30),
    size=st.integers(0, 50),
)
def test_arbitrary_text_matches_the_reference_model(prefix: str, rest: str, size: int) -> None:
    assert outcome(prefix + rest, size) == reference(prefix + rest, size)


@given(header=st.text(max_size=60), size=st.integers(0, 1 << 40))
def test_arbitrary_text_never_fails_otherwise(header: str, size: int) -> None:
    try:
        ranges = parse_range(header, size)
    except InvalidRange as e:
        assert e.size == size
        return
    if ranges is not None:
        assert 1 <= len(ranges) <= MAX_RANGES
        assert all(0 <= r.start < r.end <= size for r in ranges)


@given(
    block=st.binary(min_size=1, max_size=300),
    first=st.integers(0, 400),
    last=st.integers(0, 400),
)
def test_content_range_describes_the_bytes_served(block: bytes, first: int, last: int) -> None:
    first, last = min(first, last), max(first, last)
    size = len(block)
    try:
        ranges = parse_range(f"bytes={first}-{last}", size)
    except InvalidRange:
        assert first >= size
        return
    assert ranges is not None and len(ranges) == 1
    r = ranges[0]
    body = block[r.start : r.end]
    assert body == block[first : last + 1]
    assert r.content_range(size) == f"bytes {first}-{first + len(body) - 1}/{size}"


# -- If-None-Match ------------------------------------------------------------------

ETAG = '"0123abcd"'


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, False),
        ("*", True),
        (" * ", True),
        ('"0123abcd"', True),
        ('W/"0123abcd"', True),  # weak comparison (RFC 9110 §8.8.3.2)
        ('"0123abce"', False),
        ('"0123ABCD"', False),  # opaque-tags compare exactly
        ('"x", "0123abcd"', True),
        ('"x","0123abcd"', True),
        ('"x" ,\t"0123abcd" ', True),
        ('"x", W/"0123abcd"', True),
        (',, "0123abcd" ,', True),  # empty list elements are ignored
        ('"x", "y"', False),
        ('""', False),
        ("", False),
        (" , ", False),
        # malformed: matches nothing
        ("0123abcd", False),  # not quoted
        ('w/"0123abcd"', False),  # "W/" is case-sensitive
        ('W/ "0123abcd"', False),
        ('"0123abcd', False),  # no closing quote
        ('"x" "0123abcd"', False),  # no comma
        ('"0123abcd"x', False),
        ('*, "0123abcd"', False),  # "*" is not a list element
        ('"0123abcd", *', False),
        ('"x\x01", "0123abcd"', False),  # a control character in an opaque-tag
    ],
)
def test_etag_matches(header: str | None, expected: bool) -> None:
    assert etag_matches(header, ETAG) is expected


def test_etag_with_a_comma_inside_is_one_tag() -> None:
    # etagc includes ",": the list is scanned, not split on commas.
    assert etag_matches('"a,b"', '"a,b"') is True
    assert etag_matches('"x", "a,b"', '"a,b"') is True
    assert etag_matches('"a", "b"', '"a,b"') is False
    assert etag_matches('"a,b"', '"a"') is False


def test_weak_own_etag_compares_weakly() -> None:
    assert etag_matches('"abc"', 'W/"abc"') is True
    assert etag_matches('W/"abc"', 'W/"abc"') is True


@pytest.mark.parametrize("bad", ["0123abcd", "", '"a", "b"', '"a', '"a"x', ',"a"', 'w/"a"'])
def test_own_etag_must_be_one_entity_tag(bad: str) -> None:
    with pytest.raises(ValueError, match="etag must be one quoted entity-tag"):
        etag_matches("*", bad)


@given(
    tags=st.lists(st.text(alphabet="abcdef0123456789,-", max_size=12), max_size=5),
    own=st.text(alphabet="abcdef0123456789,-", max_size=12),
    weak=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_etag_list_property(tags: list[str], own: str, weak: list[bool]) -> None:
    header = ", ".join(("W/" if w else "") + f'"{t}"' for t, w in zip(tags, weak, strict=False))
    assert etag_matches(header, f'"{own}"') is (own in tags)

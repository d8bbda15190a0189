"""format.py: every layout round-trips, and every validation fails on its own."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.engine.format import (
    ALIGN,
    CODEC_RAW,
    CODEC_ZSTD_BP2,
    FOOTER_ENTRY,
    KIND_BLOCK,
    REC_FLAG_SEALED,
    RECORD_HEADER,
    TRAILER,
    VERSIONS_READ,
    FooterEntry,
    FrameEntry,
    RecordHeader,
    SegmentHeader,
    Trailer,
    decode_footer,
    decode_record_header,
    encode_footer,
)
from kvstore.errors import FormatError, NewerFormat, UnknownFlags

keys = st.text(alphabet="abcXYZ019._~:@=+-", min_size=1, max_size=256)
tenants = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,63}", fullmatch=True)


@st.composite
def record_headers(draw: st.DrawFn) -> RecordHeader:
    frame_size = draw(st.sampled_from([4096, 65536, 1 << 20]))
    size = draw(st.integers(1, frame_size * 5))
    nframes = -(-size // frame_size)
    frames = tuple(
        FrameEntry(
            draw(st.integers(1, frame_size + 64)), draw(st.sampled_from([0, 1, 2])), draw(st.integers(0, 2**64 - 1))
        )
        for _ in range(nframes)
    )
    tenant, key = draw(tenants), draw(keys)
    direct = draw(st.booleans())
    payload = sum(f.stored_len for f in frames)
    header_len, payload_offset, record_len = RecordHeader.sizes(tenant, key, nframes, payload, direct)
    return RecordHeader(
        KIND_BLOCK,
        draw(st.sampled_from([0, REC_FLAG_SEALED])),
        header_len,
        payload_offset,
        tenant,
        key,
        draw(st.integers(0, 2**32 - 1)),
        frame_size,
        size,
        payload,
        record_len,
        draw(st.binary(min_size=16, max_size=16)),
        draw(st.integers(0, 2**63)),
        frames,
    )


@given(record_headers())
def test_record_header_round_trip(h: RecordHeader) -> None:
    raw = h.encode()
    assert len(raw) == h.header_len
    assert decode_record_header(raw) == h
    assert h.record_len % ALIGN == 0 and h.record_len >= h.payload_offset + h.payload_len


@given(st.integers(0, 2**64 - 1), tenants, st.booleans(), st.integers(0, 2**63))
def test_segment_header_round_trip(sid: int, tenant: str, direct: bool, created: int) -> None:
    h = SegmentHeader(sid, tenant, direct, created)
    raw = h.encode()
    assert len(raw) == ALIGN
    assert SegmentHeader.decode(raw) == h


@given(
    st.lists(
        st.builds(
            FooterEntry,
            st.integers(0, 2**63),
            st.integers(0, 2**63),
            st.integers(0, 2**63),
            st.integers(0, 2**63),
            st.binary(min_size=16, max_size=16),
            st.integers(0, 2**32 - 1),
            st.integers(0, 2**32 - 1),
            st.integers(0, 3),
            st.sampled_from([1, 2]),
            keys,
        ),
        max_size=20,
    )
)
def test_footer_round_trip(entries: list[FooterEntry]) -> None:
    raw = encode_footer(entries)
    assert decode_footer(raw, len(entries)) == entries


def test_trailer_round_trip() -> None:
    t = Trailer(8192, 100, 3, 12345, 99)
    assert Trailer.decode(t.encode()) == t
    assert len(t.encode()) == TRAILER.size


def _header() -> RecordHeader:
    frames = (FrameEntry(100, CODEC_ZSTD_BP2, 7), FrameEntry(50, CODEC_RAW, 8))
    hl, po, rl = RecordHeader.sizes("t", "k", 2, 150, False)
    return RecordHeader(KIND_BLOCK, REC_FLAG_SEALED, hl, po, "t", "k", 1, 4096, 5000, 150, rl, b"r" * 16, 1, frames)


def _recrc(raw: bytearray) -> bytearray:
    struct.pack_into("<I", raw, RECORD_HEADER.size - 4, 0)
    struct.pack_into("<I", raw, RECORD_HEADER.size - 4, zlib.crc32(raw))
    return raw


def test_bad_record_magic() -> None:
    raw = bytearray(_header().encode())
    raw[0:4] = b"XXXX"
    with pytest.raises(FormatError, match="magic"):
        decode_record_header(raw)


def test_bad_record_checksum() -> None:
    raw = bytearray(_header().encode())
    raw[-1] ^= 1
    with pytest.raises(FormatError, match="checksum"):
        decode_record_header(raw)


def test_unknown_record_flag() -> None:
    raw = bytearray(_header().encode())
    struct.pack_into("<H", raw, 6, REC_FLAG_SEALED | 0x80)
    with pytest.raises(UnknownFlags, match="unknown flags"):
        decode_record_header(_recrc(raw))


def test_unknown_codec() -> None:
    h = _header()
    raw = bytearray(h.encode())
    struct.pack_into("<H", raw, RECORD_HEADER.size + 2 + 4, 9)  # first frame entry's codec
    with pytest.raises(UnknownFlags, match="codec"):
        decode_record_header(_recrc(raw))


def test_newer_record_version_is_refused_as_newer_not_as_damage() -> None:
    """An intact header of a later release's record: NewerFormat (which
    recovery never takes for a torn tail); with a failed checksum it is
    damage, whatever its version byte says (a torn tail is cut as before)."""
    raw = bytearray(_header().encode())
    raw[4] = max(VERSIONS_READ) + 1
    newer = r"record \(segment t/1\.seg, offset 8192\) is in format version 2, written by a newer kvstore"
    with pytest.raises(NewerFormat, match=newer + r".*reads version 1 only\. Upgrade kvstore"):
        decode_record_header(_recrc(bytearray(raw)), "t/1.seg", 8192)
    with pytest.raises(FormatError, match="checksum"):
        decode_record_header(raw)


def test_record_version_zero_is_damage() -> None:
    raw = bytearray(_header().encode())
    raw[4] = 0
    with pytest.raises(FormatError, match="version 0 is none kvstore ever wrote"):
        decode_record_header(_recrc(raw))


def test_newer_segment_version_is_refused_as_newer_not_as_damage() -> None:
    raw = bytearray(SegmentHeader(1, "t", False, 0).encode())
    struct.pack_into("<H", raw, 8, max(VERSIONS_READ) + 1)
    with pytest.raises(FormatError, match="checksum"):  # damage, whatever the version byte says
        SegmentHeader.decode(raw, "t/1.seg")
    struct.pack_into("<I", raw, 97, zlib.crc32(bytes(raw[:97])))
    with pytest.raises(NewerFormat, match=r"segment header .* format version 2, written by a newer kvstore"):
        SegmentHeader.decode(raw, "t/1.seg")
    struct.pack_into("<H", raw, 8, 0)
    struct.pack_into("<I", raw, 97, zlib.crc32(bytes(raw[:97])))
    with pytest.raises(FormatError, match="version 0 is none kvstore ever wrote"):
        SegmentHeader.decode(raw)


def test_truncated_header() -> None:
    with pytest.raises(FormatError, match="truncated"):
        decode_record_header(_header().encode()[:50])


def test_frame_lengths_must_add_up() -> None:
    raw = bytearray(_header().encode())
    struct.pack_into("<Q", raw, 44, 999)  # payload_len
    with pytest.raises(FormatError):
        decode_record_header(_recrc(raw))


def test_segment_header_errors() -> None:
    raw = bytearray(SegmentHeader(1, "t", False, 0).encode())
    bad = bytearray(raw)
    bad[0] = ord("X")
    with pytest.raises(FormatError, match="magic"):
        SegmentHeader.decode(bad)
    bad = bytearray(raw)
    bad[20] ^= 1
    with pytest.raises(FormatError, match="checksum"):
        SegmentHeader.decode(bad)
    bad = bytearray(raw)
    struct.pack_into("<H", bad, 10, 0x4)
    struct.pack_into("<I", bad, 97, zlib.crc32(bytes(bad[:97])))
    with pytest.raises(UnknownFlags):
        SegmentHeader.decode(bad)


def test_trailer_errors() -> None:
    raw = bytearray(Trailer(8192, 100, 3, 1, 2).encode())
    raw[10] ^= 1
    with pytest.raises(FormatError, match="checksum"):
        Trailer.decode(raw)
    with pytest.raises(FormatError, match="trailer"):
        Trailer.decode(b"\0" * TRAILER.size)


def test_footer_with_non_ascii_key_raised_unicode_error() -> None:
    """Found by tests/fuzz/test_decoder_fuzz.py: a footer entry whose key bytes
    are not ASCII raised UnicodeDecodeError (a crash of recovery, not a
    reported corruption) instead of FormatError."""
    entry = FOOTER_ENTRY.pack(4096, 4096, 1, 0, bytes(16), 0, 0, 0, 1, 0, 1) + b"\x80"
    with pytest.raises(FormatError, match="not ASCII"):
        decode_footer(entry, 1)

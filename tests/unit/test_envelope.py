"""The record envelope of ``GET /v1/records/{key}`` (docs/API.md, "Records
as stored"), pinned byte for byte: clients of other releases read it, so the
daemon's head and meta must stay exactly these bytes, and the client must
read them back as the record they describe."""

from __future__ import annotations

from kvstore_client import record as client_record

from kvstore.engine.api import FrameEntry, StoredFrames
from kvstore.engine.format import REC_FLAG_SEALED, RecordHeader
from kvstore.transport.http.routes import records

FRAMES = (FrameEntry(1000, 0, 0x0123456789ABCDEF), FrameEntry(900, 1, 0xFEDCBA9876543210), FrameEntry(116, 2, 7))
SEALED_HEAD = (
    b'KVE1s\x01\x00\x00{"tenant":"acme","key":"blk:0001","size":2100,"start":1500,"end":2100,'
    b'"record_id":"000102030405060708090a0b0c0d0e0f","key_version":2,"frame_size":1024,"frame_count":3,'
    b'"first":1,"frames":[{"len":900,"codec":"zstd","xxh3":"fedcba9876543210"},'
    b'{"len":116,"codec":"zstd-bp2","xxh3":"0000000000000007"}],"sealed":true,'
    b'"frame_key":"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="}'
)
DIRECT_HEAD = (
    b'KVE1\x0e\x01\x00\x00{"tenant":"acme","key":"blk:0002","size":1000,"start":0,"end":1000,'
    b'"record_id":"101112131415161718191a1b1c1d1e1f","key_version":0,"frame_size":1024,"frame_count":1,'
    b'"first":0,"frames":[{"len":1000,"codec":"raw","xxh3":"0123456789abcdef"}],"sealed":false,"frame_key":null}'
)


def _header(
    key: str, flags: int, key_version: int, size: int, record_id: bytes, frames: tuple[FrameEntry, ...]
) -> RecordHeader:
    return RecordHeader(1, flags, 0, 0, "acme", key, key_version, 1024, size, 0, 0, record_id, 0, frames)


def sealed_frames() -> StoredFrames:
    """Frames 1..2 of a sealed record of 2100 bytes in frames of 1 KiB."""
    h = _header("blk:0001", REC_FLAG_SEALED, 2, 2100, bytes(range(16)), FRAMES)
    return StoredFrames(h, 1, 2, 0, memoryview(b""), bytes(range(32)))


def direct_frames() -> StoredFrames:
    """The one raw frame of a direct tenant's record."""
    h = _header("blk:0002", 0, 0, 1000, bytes(range(16, 32)), FRAMES[:1])
    return StoredFrames(h, 0, 0, 0, memoryview(b""), None)


def daemon_head(key: str, size: int, start: int, end: int, frames: StoredFrames) -> bytes:
    return records.envelope_head(records.record_meta("acme", key, size, start, end, frames))


def test_the_daemon_writes_a_sealed_records_envelope_as_before() -> None:
    assert daemon_head("blk:0001", 2100, 1500, 2100, sealed_frames()) == SEALED_HEAD


def test_the_daemon_writes_a_direct_records_envelope_as_before() -> None:
    assert daemon_head("blk:0002", 1000, 0, 1000, direct_frames()) == DIRECT_HEAD


def test_the_client_reads_the_envelope_the_daemon_writes() -> None:
    magic, n = client_record.HEAD.unpack_from(SEALED_HEAD)
    assert (magic, n) == (b"KVE1", len(SEALED_HEAD) - 8)
    m = client_record.parse_meta(SEALED_HEAD[8:], "blk:0001")
    assert (m.tenant, m.key, m.size, m.start, m.end, m.first) == ("acme", "blk:0001", 2100, 1500, 2100, 1)
    assert (m.record_id, m.key_version, m.frame_size, m.frame_count) == (bytes(range(16)), 2, 1024, 3)
    assert [(f.length, f.codec, f.xxh3) for f in m.frames] == [(900, "zstd", 0xFEDCBA9876543210), (116, "zstd-bp2", 7)]
    assert m.frame_key == bytes(range(32))
    assert client_record.parse_meta(DIRECT_HEAD[8:], "blk:0002").frame_key is None

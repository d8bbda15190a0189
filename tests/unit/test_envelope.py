"""The record envelope of ``GET /v1/records/{key}`` (docs/API.md, "Records
as stored"), pinned byte for byte: clients of other releases read it, so the
daemon's head and meta must stay exactly these bytes, and the client must
read them back as the record they describe."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvstore_client import record as client_record
from kvstore_client.errors import CorruptBlock, ProtocolError
from kvstore_client.wire import envelope
from kvstore_client.wire.codec import CODECS
from kvstore_client.wire.errors import BadEnvelope, NewerEnvelope, OtherRecord

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
    return envelope.pack_head(records.record_meta("acme", key, size, start, end, frames))


def test_the_daemon_writes_a_sealed_records_envelope_as_before() -> None:
    assert daemon_head("blk:0001", 2100, 1500, 2100, sealed_frames()) == SEALED_HEAD


def test_the_daemon_writes_a_direct_records_envelope_as_before() -> None:
    assert daemon_head("blk:0002", 1000, 0, 1000, direct_frames()) == DIRECT_HEAD


def test_the_client_reads_the_envelope_the_daemon_writes() -> None:
    assert envelope.meta_len(SEALED_HEAD[:8]) == len(SEALED_HEAD) - 8
    m = client_record.parse_meta(SEALED_HEAD[8:], "blk:0001")
    assert (m.tenant, m.key, m.size, m.start, m.end, m.first) == ("acme", "blk:0001", 2100, 1500, 2100, 1)
    assert (m.record_id, m.key_version, m.frame_size, m.frame_count) == (bytes(range(16)), 2, 1024, 3)
    assert [(f.length, f.codec, f.xxh3) for f in m.frames] == [(900, "zstd", 0xFEDCBA9876543210), (116, "zstd-bp2", 7)]
    assert m.frame_key == bytes(range(32))
    assert client_record.parse_meta(DIRECT_HEAD[8:], "blk:0002").frame_key is None


@st.composite
def metas(draw: st.DrawFn) -> envelope.RecordMeta:
    """A consistent meta: some frames of a record, covering a range of it."""
    frame_size = draw(st.integers(1, 1 << 20))
    size = draw(st.integers(1, 64 * frame_size))
    start = draw(st.integers(0, size - 1))
    end = draw(st.integers(start + 1, size))
    first, last = start // frame_size, (end - 1) // frame_size
    frame = st.builds(
        envelope.StoredFrame, st.integers(0, 1 << 21), st.sampled_from(sorted(CODECS)), st.integers(0, 2**64 - 1)
    )
    return envelope.RecordMeta(
        tenant=draw(st.text("abc-_", min_size=1, max_size=8)),
        key=draw(st.text("abc:019", min_size=1, max_size=8)),
        size=size,
        start=start,
        end=end,
        record_id=draw(st.binary(min_size=16, max_size=16)),
        key_version=draw(st.integers(0, 2**32 - 1)),
        frame_size=frame_size,
        frame_count=-(-size // frame_size),
        first=first,
        frames=tuple(draw(frame) for _ in range(last - first + 1)),
        frame_key=draw(st.none() | st.binary(min_size=32, max_size=32)),
    )


@given(metas())
def test_the_meta_reads_back_as_written(meta: envelope.RecordMeta) -> None:
    head = envelope.pack_head(envelope.meta_doc(meta))
    assert envelope.meta_len(head[: envelope.HEAD.size]) == len(head) - envelope.HEAD.size
    assert envelope.parse_meta(head[envelope.HEAD.size :], meta.key) == meta


def test_a_later_releases_envelope_says_upgrade() -> None:
    with pytest.raises(NewerEnvelope, match=r"b'KVE2' is a newer daemon's.*upgrade kvstore-client"):
        envelope.meta_len(b"KVE2" + SEALED_HEAD[4:8])


@pytest.mark.parametrize("head", [b"HTTP\x00\x00\x00\x00", b"KVE1" + (envelope.MAX_META + 1).to_bytes(4, "little")])
def test_what_is_not_an_envelope_is_refused(head: bytes) -> None:
    with pytest.raises(BadEnvelope, match="not a record envelope"):
        envelope.meta_len(head)


def _doc(**changes: object) -> bytes:
    doc = json.loads(SEALED_HEAD[8:]) | changes
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{", "bad JSON"),
        (b"[]", "meta is not an object"),
        (_doc(size="2100"), "field 'size' is missing or not int"),
        (_doc(size=True), "field 'size' is missing or not int"),
        (
            _doc(frames=[{"len": 900, "codec": "lz4", "xxh3": "00"}, {"len": 1, "codec": "raw", "xxh3": "00"}]),
            "unknown frame codec 'lz4'",
        ),
        (_doc(frames=[7]), "a frame entry is not an object"),
        (_doc(frames=[{"len": 900, "codec": "raw", "xxh3": "xyz"}]), "xxh3 is not hex"),
        (_doc(frame_key="not base64!"), "frame_key or record_id is not well formed"),
        (_doc(sealed=False), "only a sealed one has one"),
        (_doc(record_id="00"), "record id, frame size or size out of range"),
        (_doc(frame_count=2), "2 frames cannot hold 2100 bytes"),
        (_doc(end=2101), "range [1500, 2101) is not within 2100 bytes"),
        (_doc(first=0), "the frames sent do not cover the range"),
    ],
)
def test_a_broken_meta_says_what_is_wrong_and_the_client_calls_it_a_protocol_error(raw: bytes, message: str) -> None:
    with pytest.raises(BadEnvelope, match=re.escape(message)):
        envelope.parse_meta(raw, "blk:0001")
    with pytest.raises(ProtocolError, match=re.escape(message)):
        client_record.parse_meta(raw, "blk:0001")


def test_a_record_of_another_key_is_corrupt_for_the_client() -> None:
    with pytest.raises(OtherRecord, match="asked for block blk:0009 but the daemon sent a record of 'blk:0001'"):
        envelope.parse_meta(SEALED_HEAD[8:], "blk:0009")
    with pytest.raises(CorruptBlock, match="asked for block blk:0009"):
        client_record.meta_of(json.loads(SEALED_HEAD[8:]), "blk:0009")

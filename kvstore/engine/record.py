"""A block as a record: frames compressed and sealed one by one, and back.

Frame work is independent per frame, so callers may run :func:`encode_frame`
and :func:`open_frame` for several frames on several threads (zstd, AES-GCM
and xxhash release the GIL).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace

from kvstore.config import Compression
from kvstore.engine import codec
from kvstore.engine.crypto import RecordCipher
from kvstore.engine.format import (
    ALIGN,
    CODEC_RAW,
    GCM_TAG,
    KIND_BLOCK,
    KIND_PAD,
    KIND_TOMBSTONE,
    REC_FLAG_DIRECT,
    REC_FLAG_SEALED,
    FooterEntry,
    FrameEntry,
    RecordHeader,
    align_up,
    checksum,
)
from kvstore.engine.index import IndexEntry
from kvstore.engine.segment import Buffer, padding
from kvstore.errors import CorruptionError


@dataclass(slots=True)
class EncodedRecord:
    """A record ready to append: its header and the buffers to write, in order."""

    header: RecordHeader
    buffers: list[Buffer]

    @property
    def length(self) -> int:
        return self.header.record_len


def frame_count(size: int, frame_size: int) -> int:
    return -(-size // frame_size)


def block_record_len(tenant: str, key: str, size: int, frame_size: int, sealed: bool) -> int:
    """The bytes a block of ``size`` bytes takes in its segment (what its
    tenant's quota counts, ``bytes_stored``) when none of its frames
    compresses: a direct record (raw frames after a header padded to
    ``ALIGN``) or a sealed one (each frame with its GCM tag, right after the
    header); either ends on an ``ALIGN`` boundary. Compression only makes a
    sealed record shorter. Beyond it: the segment footer's entry and the
    index entry (about 100 bytes with the key each), not counted."""
    n = frame_count(size, frame_size)
    payload = size + (GCM_TAG * n if sealed else 0)
    return RecordHeader.sizes(tenant, key, n, payload, not sealed)[2]


def new_record_id() -> bytes:
    return os.urandom(16)


def encode_frame(
    cipher: RecordCipher | None, index: int, plain: memoryview, compression: Compression, level: int
) -> tuple[FrameEntry, Buffer]:
    """Compress (when it pays) and seal one frame; return its entry and bytes."""
    codec_id, encoded = codec.encode_frame(plain, compression, level)
    stored: Buffer = encoded
    if cipher is not None:
        stored = cipher.seal(index, stored)
    return FrameEntry(len(stored), codec_id, checksum(stored)), stored


def assemble(
    tenant: str,
    key: str,
    data_len: int,
    frame_size: int,
    frames: list[tuple[FrameEntry, Buffer]],
    record_id: bytes,
    key_version: int,
    sealed: bool,
    direct: bool,
) -> EncodedRecord:
    payload_len = sum(f.stored_len for f, _ in frames)
    header_len, payload_offset, record_len = RecordHeader.sizes(tenant, key, len(frames), payload_len, direct)
    flags = (REC_FLAG_SEALED if sealed else 0) | (REC_FLAG_DIRECT if direct else 0)
    header = RecordHeader(
        KIND_BLOCK,
        flags,
        header_len,
        payload_offset,
        tenant,
        key,
        key_version,
        frame_size,
        data_len,
        payload_len,
        record_len,
        record_id,
        time.time_ns(),
        tuple(f for f, _ in frames),
    )
    buffers: list[Buffer] = [header.encode(), bytes(payload_offset - header_len)]
    buffers.extend(stored for _, stored in frames)
    buffers.append(padding(payload_offset + payload_len))
    return EncodedRecord(header, buffers)


def tombstone(tenant: str, key: str, deletes_from: int = 0) -> EncodedRecord:
    """A record that deletes ``key``; ``deletes_from``: the id of the segment
    that holds the record it deletes (kept in ``logical_size``, see format.py)."""
    header_len, payload_offset, record_len = RecordHeader.sizes(tenant, key, 0, 0, False)
    header = RecordHeader(
        KIND_TOMBSTONE,
        0,
        header_len,
        payload_offset,
        tenant,
        key,
        0,
        0,
        deletes_from,
        0,
        record_len,
        new_record_id(),
        time.time_ns(),
        (),
    )
    raw = header.encode()
    return EncodedRecord(header, [raw, padding(len(raw))])


def pad(tenant: str, record_len: int) -> bytes:
    """The first ALIGN bytes of a pad record ``record_len`` long (format.py):
    space that holds no record (yet)."""
    header_len, _, _ = RecordHeader.sizes(tenant, "", 0, 0, False)
    header = RecordHeader(
        KIND_PAD, 0, header_len, header_len, tenant, "", 0, 0, 0, 0, record_len, bytes(16), time.time_ns(), ()
    )
    raw = header.encode()
    return raw + bytes(ALIGN - len(raw))


def planned(
    tenant: str, key: str, size: int, frame_size: int, record_id: bytes, sealed_with: int | None = None
) -> RecordHeader:
    """The header of a block of ``size`` bytes whose frames a client writes
    itself (a write plan), as reserved: raw frames, checksums still zero.
    ``sealed_with``: the data key version the client seals its frames under
    (client-side encode); the room reserved is then each frame's most, its
    plaintext and its tag (a frame is compressed only when that shrinks it)."""
    n = frame_count(size, frame_size)
    tag = 0 if sealed_with is None else GCM_TAG
    frames = tuple(FrameEntry(min(frame_size, size - i * frame_size) + tag, CODEC_RAW, 0) for i in range(n))
    payload_len = sum(f.stored_len for f in frames)
    header_len, payload_offset, record_len = RecordHeader.sizes(tenant, key, n, payload_len, True)
    # Both start their payload on an ALIGN boundary (O_DIRECT writes); only a
    # direct one is flagged so (its frames are raw and sent as they are).
    flags = REC_FLAG_DIRECT if sealed_with is None else REC_FLAG_SEALED
    return RecordHeader(
        KIND_BLOCK,
        flags,
        header_len,
        payload_offset,
        tenant,
        key,
        sealed_with or 0,
        frame_size,
        size,
        payload_len,
        record_len,
        record_id,
        time.time_ns(),
        frames,
    )


def as_written(reserved: RecordHeader, frames: tuple[FrameEntry, ...]) -> RecordHeader:
    """The header of a planned record once its frames are known: their
    stored lengths, codecs and checksums; the record as long as they need
    (at most the room reserved: the rest of it becomes a pad)."""
    payload_len = sum(f.stored_len for f in frames)
    record_len = align_up(reserved.payload_offset + payload_len)
    assert len(frames) == len(reserved.frames) and record_len <= reserved.record_len
    return replace(reserved, payload_len=payload_len, record_len=record_len, frames=frames)


_local = threading.local()


def scratch(n: int) -> memoryview:
    """A per-thread buffer of ``n`` bytes, reused from call to call (a fresh
    multi-megabyte buffer per frame costs more than decrypting it)."""
    buf: bytearray | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = bytearray(max(n, 1 << 20))
    return memoryview(buf)[:n]


def open_frame(
    cipher: RecordCipher | None,
    header: RecordHeader,
    index: int,
    stored: memoryview,
    out: memoryview,
    where: str,
    offset: int,
) -> None:
    """Verify, decrypt and decode frame ``index`` into ``out`` (its full plaintext)."""
    entry = header.frames[index]
    if checksum(stored) != entry.checksum:
        raise CorruptionError(f"frame {index} of key {header.key!r} fails its checksum", where, offset)
    try:
        if cipher is None:
            codec.decode_frame(entry.codec, stored, out)
        elif entry.codec == CODEC_RAW:
            cipher.open_into(index, stored, out)
        else:
            plain = scratch(len(stored) - 16)
            cipher.open_into(index, stored, plain)
            codec.decode_frame(entry.codec, plain, out)
    except CorruptionError as e:
        raise CorruptionError(f"key {header.key!r}: {e}", where, offset) from None


def footer_entry(offset: int, h: RecordHeader) -> FooterEntry:
    """The footer entry of the record with header ``h`` at ``offset``."""
    return FooterEntry(
        offset,
        h.record_len,
        h.logical_size,
        h.created_ns,
        h.record_id,
        h.key_version,
        h.payload_offset,
        h.flags,
        h.kind,
        h.key,
    )


def index_entry(segment_id: int, fe: FooterEntry) -> IndexEntry | None:
    """The index entry a record implies (None: the record is a tombstone)."""
    if fe.kind == KIND_TOMBSTONE:
        return None
    return IndexEntry(
        segment_id,
        fe.offset,
        fe.record_len,
        fe.payload_offset,
        fe.logical_size,
        fe.flags,
        fe.key_version,
        fe.record_id,
        fe.created_ns,
    )

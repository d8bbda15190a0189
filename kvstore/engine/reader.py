"""The read path, as plain functions run on executor threads.

A read of bytes [start, end) of a block loads only the stored frames that
cover the range (one pread for small records, header + frames for big ones),
checks that the record is the one the index names (tenant, key, record id),
and decodes each frame into the caller's output buffer; frames that lie wholly
inside the range are decoded in place, with no intermediate copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvstore.engine import verified
from kvstore.engine.crypto import RecordCipher, derive_frame_key
from kvstore.engine.format import CODEC_RAW, KIND_BLOCK, REC_FLAG_DIRECT, RecordHeader, checksum, decode_record_header
from kvstore.engine.index import IndexEntry
from kvstore.engine.record import open_frame
from kvstore.engine.registry import Registry
from kvstore.engine.segment import SegmentFile
from kvstore.errors import CorruptionError

__all__ = [
    "REC_FLAG_DIRECT",
    "Loaded",
    "StoredFrames",
    "decode_into",
    "direct_view",
    "load",
    "read_all_inline",
    "read_direct_whole",
    "stored_frames",
]

# Records up to this size are read with a single pread, header and all.
WHOLE_READ_MAX = 4 << 20


class RecordSource(Protocol):
    """What :func:`load` reads a record from: a local :class:`SegmentFile`, or
    a record fetched from the object tier (remote.FetchedRecord)."""

    @property
    def name(self) -> str: ...

    def pread(self, offset: int, length: int) -> bytearray | memoryview: ...

    def read_header_at(self, offset: int) -> RecordHeader: ...


@dataclass(slots=True)
class Loaded:
    """Stored frames [first, last] of a record, read from its segment."""

    seg: RecordSource
    entry: IndexEntry
    header: RecordHeader
    first: int
    last: int
    stored: memoryview  # the stored bytes of frames first..last, back to back
    frame_at: list[int]  # offset of each frame in ``stored`` (index i - first)
    cipher: RecordCipher | None


def load(
    seg: RecordSource, entry: IndexEntry, tenant: str, key: str, start: int, end: int, registry: Registry
) -> Loaded:
    """Read the header and the stored frames covering [start, end)."""
    where = seg.name
    if entry.record_len <= WHOLE_READ_MAX:
        raw = memoryview(seg.pread(entry.offset, entry.record_len))
        header = decode_record_header(raw, where, entry.offset)
    else:
        raw = None
        header = seg.read_header_at(entry.offset)
    _check_identity(header, entry, tenant, key, where)
    fs = header.frame_size
    first, last = start // fs, (end - 1) // fs
    offsets = header.frame_offsets()
    lo = offsets[first]
    hi = offsets[last] + header.frames[last].stored_len
    if raw is not None:
        stored = raw[header.payload_offset + lo : header.payload_offset + hi]
    else:
        stored = memoryview(seg.pread(entry.offset + header.payload_offset + lo, hi - lo))
    cipher = None
    if header.sealed:
        cipher = RecordCipher(
            registry.data_key(tenant, header.key_version),
            header.record_id,
            tenant,
            key,
            header.key_version,
            len(header.frames),
            header.logical_size,
        )
    return Loaded(seg, entry, header, first, last, stored, [o - lo for o in offsets[first : last + 1]], cipher)


def _check_identity(header: RecordHeader, entry: IndexEntry, tenant: str, key: str, where: str) -> None:
    if (
        header.kind != KIND_BLOCK
        or header.tenant != tenant
        or header.key != key
        or header.record_id != entry.record_id
        or header.logical_size != entry.logical_size
        or header.payload_offset != entry.payload_offset
    ):
        raise CorruptionError(f"the index entry of key {key!r} points at a different record", where, entry.offset)


def decode_into(ld: Loaded, i: int, start: int, end: int, out: memoryview) -> None:
    """Decode frame ``i`` and place its part of [start, end) into ``out``
    (which holds exactly bytes [start, end) of the block)."""
    h = ld.header
    at = ld.frame_at[i - ld.first]
    stored = ld.stored[at : at + h.frames[i].stored_len]
    f_lo = i * h.frame_size
    f_hi = f_lo + h.frame_plain_len(i)
    lo, hi = max(start, f_lo), min(end, f_hi)
    where, offset = ld.seg.name, ld.entry.offset
    if lo == f_lo and hi == f_hi:
        open_frame(ld.cipher, h, i, stored, out[lo - start : hi - start], where, offset)
        return
    tmp = bytearray(f_hi - f_lo)
    open_frame(ld.cipher, h, i, stored, memoryview(tmp), where, offset)
    out[lo - start : hi - start] = memoryview(tmp)[lo - f_lo : hi - f_lo]


def read_direct_whole(seg: SegmentFile, entry: IndexEntry, tenant: str, key: str) -> bytearray:
    """A whole direct (raw, unsealed) block: one preadv of the header and the
    payload straight into the output buffer, frame checksums checked in place."""
    out = bytearray(entry.logical_size)
    head = bytearray(entry.payload_offset)
    seg.preadv_into([memoryview(head), memoryview(out)], entry.offset)
    header = decode_record_header(head, seg.name, entry.offset)
    _check_identity(header, entry, tenant, key, seg.name)
    _verify_raw_frames(header, memoryview(out), key, seg.name, entry.offset)
    return out


def direct_view(seg: SegmentFile, entry: IndexEntry, tenant: str, key: str, start: int, end: int) -> memoryview:
    """Bytes [start, end) of a direct block as a read-only view into the
    segment's mapping: the frames that cover them are verified over the mapped
    bytes (no copy, no allocation); the caller sends the view as it is. The
    view starts at byte ``entry.offset + entry.payload_offset + start`` of the
    segment file (what sendfile sends from)."""
    base = entry.offset + entry.payload_offset
    view = seg.mapped(base + entry.logical_size)
    header = verified.header_of(seg, entry.offset)
    try:
        if header is None:
            header = decode_record_header(view[entry.offset : base], seg.name, entry.offset)
        _check_identity(header, entry, tenant, key, seg.name)
        fs = header.frame_size
        first, last = start // fs, (end - 1) // fs
        if verified.unverified(seg, entry.offset, first, last):
            lo, hi = first * fs, min(entry.logical_size, (last + 1) * fs)
            _verify_raw_frames(header, view[base:], key, seg.name, entry.offset, first, last, lo, hi)
            verified.mark(seg, entry.offset, header, first, last)
    except CorruptionError:
        verified.forget(seg)
        raise
    return view[base + start : base + end]


def direct_header(seg: SegmentFile, entry: IndexEntry, tenant: str, key: str) -> RecordHeader:
    """The header of a direct record, its identity checked against the index
    entry (a read plan hands the frames' checksums to the client)."""
    base = entry.offset + entry.payload_offset
    view = seg.mapped(base)
    header = decode_record_header(view[entry.offset : base], seg.name, entry.offset)
    _check_identity(header, entry, tenant, key, seg.name)
    if header.sealed or any(f.codec != CODEC_RAW for f in header.frames):
        raise CorruptionError(f"direct record of key {key!r} has encoded frames", seg.name, entry.offset)
    return header


def _verify_raw_frames(
    header: RecordHeader,
    payload: memoryview,
    key: str,
    where: str,
    offset: int,
    first: int = 0,
    last: int | None = None,
    lo: int = 0,
    hi: int | None = None,
) -> None:
    """Check raw frames ``first``..``last`` (payload bytes [lo, hi)) of a direct record."""
    last = len(header.frames) - 1 if last is None else last
    hi = header.logical_size if hi is None else hi
    pos = lo
    for i in range(first, last + 1):
        f = header.frames[i]
        if f.codec != CODEC_RAW or header.sealed or f.stored_len != header.frame_plain_len(i):
            raise CorruptionError(f"direct record of key {key!r} has an encoded frame {i}", where, offset)
        if checksum(payload[pos : pos + f.stored_len]) != f.checksum:
            raise CorruptionError(f"frame {i} of key {key!r} fails its checksum", where, offset)
        pos += f.stored_len
    if pos != hi:
        raise CorruptionError(f"direct record of key {key!r}: frames end at {pos}, expected {hi}", where, offset)


def read_all_inline(
    seg: RecordSource, entry: IndexEntry, tenant: str, key: str, start: int, end: int, registry: Registry
) -> bytearray:
    """Load and decode [start, end) on the calling thread (small reads)."""
    out = bytearray(end - start)
    ld = load(seg, entry, tenant, key, start, end, registry)
    view = memoryview(out)
    for i in range(ld.first, ld.last + 1):
        decode_into(ld, i, start, end, view)
    return out


@dataclass(slots=True)
class StoredFrames:
    """Stored frames [first, last] of a record, as they are on disk, and
    what opens exactly them: the record's header (its frame table) and, for
    a sealed record, its own frame key (never the tenant's data key).
    ``view`` holds the frames back to back; for a local segment it is a view
    of the segment's mapping starting at byte ``offset`` of the file."""

    header: RecordHeader
    first: int
    last: int
    offset: int
    view: memoryview
    frame_key: bytes | None


def stored_frames(
    seg: RecordSource, entry: IndexEntry, tenant: str, key: str, start: int, end: int, registry: Registry
) -> StoredFrames:
    """The stored frames that cover bytes [start, end) of a block, unopened:
    the record's identity is checked against the index entry; the frames'
    checksums and tags are left to whoever opens them (the client)."""
    if not isinstance(seg, SegmentFile):
        ld = load(seg, entry, tenant, key, start, end, registry)
        h = ld.header
        fk = None if ld.cipher is None else ld.cipher.frame_key
        lo = entry.offset + h.payload_offset + h.frame_offsets()[ld.first]
        return StoredFrames(h, ld.first, ld.last, lo, ld.stored, fk)
    base = entry.offset + entry.payload_offset
    h = decode_record_header(seg.mapped(base)[entry.offset :], seg.name, entry.offset)
    _check_identity(h, entry, tenant, key, seg.name)
    first, last = start // h.frame_size, (end - 1) // h.frame_size
    offsets = h.frame_offsets()
    lo, hi = base + offsets[first], base + offsets[last] + h.frames[last].stored_len
    fk = None
    if h.sealed:
        fk = derive_frame_key(registry.data_key(tenant, h.key_version), h.record_id, tenant, h.key_version)
    return StoredFrames(h, first, last, lo, seg.mapped(hi)[lo:], fk)

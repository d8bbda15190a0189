"""The bytes on disk. Every layout is defined here once; no I/O in this module.

All integers are little-endian. Offsets are from the start of the segment file.

Versions: the segment header and every record header carry ``VERSION`` right
after their magic. A header whose checksum holds but whose version is newer
than ``VERSIONS_READ`` was written by a later release: it is refused with
:class:`~kvstore.errors.NewerFormat` (naming the version found and the ones
read), which nothing that handles damage catches, so recovery stops instead
of cutting it off as a torn tail or skipping it as corruption. A header
whose checksum fails is damage (a torn tail at the end of an open segment),
whatever its version byte says. So every later version keeps, at the same
offsets: the magic, the version, a record's ``header_len`` (bytes 8-11) and
the checksum as computed here (a record's: crc32 of its ``header_len`` bytes
with bytes 80-83, where it is stored, zeroed; new fields go after the frame
table, inside ``header_len``; the segment header's: crc32 of bytes 0-96,
stored at 97). Footer and trailer belong to their segment's version.
docs/operations.md lists every persisted format and its version.

Segment file
============
::

    +------------------+ 0
    | segment header   |  SEG_HEADER, zero-padded to ALIGN (4096)
    +------------------+ 4096
    | record           |  each record starts on an ALIGN boundary
    | record           |
    | ...              |
    +------------------+ (sealed segments only)
    | footer           |  FOOTER_ENTRY + key bytes, per record, in file order
    | trailer          |  TRAILER, the last TRAILER.size bytes of the file
    +------------------+

SEG_HEADER  (``<8sHHIQQB64sI``, 101 bytes)
    magic        8s   b"KVSTSEG1"
    version      u16  1
    flags        u16  SEG_FLAG_DIRECT (bit 0); other bits must be 0
    reserved     u32  0
    segment_id   u64  unique and increasing per tenant
    created_ns   u64
    tenant_len   u8
    tenant       64s  the owning tenant's name, zero padded
    crc          u32  crc32 of the preceding 97 bytes

Record (a block, a tombstone that deletes a key, or a pad)
    RECORD_HEADER (``<4sBBHIIBBHIIIQQQ16sQI``, 84 bytes)
        magic          4s   b"KVR1"
        version        u8   1
        kind           u8   KIND_BLOCK (1), KIND_TOMBSTONE (2) or KIND_PAD (3)
        flags          u16  REC_FLAG_SEALED (bit 0), REC_FLAG_DIRECT (bit 1)
        header_len     u32  RECORD_HEADER + tenant + key + frame table
        payload_offset u32  from the record start; ALIGN-aligned for direct records
        tenant_len     u8
        reserved       u8   0
        key_len        u16
        key_version    u32  the tenant data key version that sealed it (0: none)
        frame_size     u32  plaintext bytes per frame (the last may be shorter)
        frame_count    u32
        logical_size   u64  plaintext size of the block; in a tombstone, the id of
                            the segment that held the record it deletes (0: not
                            recorded), so compaction knows how long it is needed
        payload_len    u64  sum of the stored frame lengths
        record_len     u64  whole record, padding included; a multiple of ALIGN
        record_id      16s  random; names the record (AAD, key derivation, ETag)
        created_ns     u64
        header_crc     u32  crc32 of header_len bytes with this field zeroed
    tenant bytes, key bytes (ASCII)
    FRAME_ENTRY per frame (``<IHHQ``, 16 bytes)
        stored_len     u32  bytes of this frame in the payload
        codec          u16  CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_BP2 (codec.py)
        reserved       u16  0
        checksum       u64  xxh3-64 of the stored frame bytes
    zero padding up to payload_offset
    payload: the stored frames back to back (sealed frames carry their GCM tag)
    zero padding up to record_len

A pad (KIND_PAD: no key, no frames) holds space ``record_len`` long that is
no record: the space a write plan reserved (write_plan.py). Its header is
written when the space is reserved; the block's own header replaces it
when the plan commits, once the client's bytes match their checksums. A pad
is never indexed and never in a footer; a scan steps over it.

Footer (sealed segments): FOOTER_ENTRY (``<QQQQ16sIIHBBH``, 68 bytes) + key
bytes per record, then TRAILER (``<8sQQIQQI``, 52 bytes) at the very end:
    magic "KVSTFTR1", footer_offset, footer_len, entry_count,
    footer_xxh3 (xxh3-64 of the footer bytes), sealed_ns, crc32 of the rest.

Integrity: headers carry a crc32 (cheap, catches torn and flipped headers);
every stored frame carries an xxh3-64 in the header, so a scrub can check
every byte without any key; sealed frames are also authenticated by AES-GCM.

Nonces (NIST SP 800-38D §8.2.1, deterministic construction)
-----------------------------------------------------------
Each sealed record gets a fresh random 128-bit ``record_id``. Its frames are
sealed with a per-record key ``HKDF-SHA256(tenant data key, salt=record_id,
info="kvstore/v1 frame key" || tenant || key version)`` and the nonce is the
frame index (96-bit, big-endian). A nonce therefore never repeats under a key:
the frame key is used for one record only, and within it each frame index once.
This holds across crashes and index rebuilds because nothing is counted: a
record rewritten after a torn write gets a new random ``record_id`` and with it
a new key. Two records share a key only if two random 128-bit ids collide; for
2^48 records that chance is below 2^-32, the bound SP 800-38D sets. (The same
construction as Tink's AES-GCM-HKDF streaming AEAD.)

The AAD of frame i binds: record_id, key_version, i, frame_count, logical_size,
tenant and key, so moving a frame to another index, record, tenant or key, or
truncating a record, fails authentication.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from kvstore.errors import FormatError, NewerFormat, UnknownFlags

ALIGN = 4096
VERSION = 1  # of segment headers and record headers; docs/operations.md lists every format's version
VERSIONS_READ = (1,)  # what this release opens; a newer one is refused (NewerFormat), never taken for damage

SEG_MAGIC = b"KVSTSEG1"
SEG_FLAG_DIRECT = 0x1
SEG_FLAGS_KNOWN = SEG_FLAG_DIRECT
SEG_HEADER = struct.Struct("<8sHHIQQB64sI")

REC_MAGIC = b"KVR1"
KIND_BLOCK = 1
KIND_TOMBSTONE = 2
KIND_PAD = 3
REC_FLAG_SEALED = 0x1
REC_FLAG_DIRECT = 0x2
REC_FLAGS_KNOWN = REC_FLAG_SEALED | REC_FLAG_DIRECT
RECORD_HEADER = struct.Struct("<4sBBHIIBBHIIIQQQ16sQI")
_HEADER_CRC_AT = RECORD_HEADER.size - 4
FRAME_ENTRY = struct.Struct("<IHHQ")

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_ZSTD_BP2 = 2
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_ZSTD_BP2: "zstd-bp2"}  # as docs/API.md names them
CODECS_KNOWN = frozenset({CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_BP2})

FOOTER_ENTRY = struct.Struct("<QQQQ16sIIHBBH")
TRAILER_MAGIC = b"KVSTFTR1"
TRAILER = struct.Struct("<8sQQIQQI")

GCM_TAG = 16
MAX_HEADER_LEN = 16 << 20


def align_up(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The per-frame checksum: xxh3-64 (~19 GB/s per core here)."""
    return xxhash.xxh3_64_intdigest(data)


# -- segment header -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    segment_id: int
    tenant: str
    direct: bool
    created_ns: int

    def encode(self) -> bytes:
        t = self.tenant.encode()
        body = SEG_HEADER.pack(
            SEG_MAGIC,
            VERSION,
            SEG_FLAG_DIRECT if self.direct else 0,
            0,
            self.segment_id,
            self.created_ns,
            len(t),
            t,
            0,
        )[:-4]
        raw = body + struct.pack("<I", zlib.crc32(body))
        return raw + bytes(ALIGN - len(raw))

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview, where: str = "") -> SegmentHeader:
        if len(buf) < SEG_HEADER.size:
            raise FormatError("segment header is truncated", where, 0)
        magic, version, flags, _r, seg_id, created, tlen, tenant, crc = SEG_HEADER.unpack_from(buf)
        if magic != SEG_MAGIC:
            raise FormatError(f"bad segment magic {bytes(magic)!r}, expected {SEG_MAGIC!r}", where, 0)
        if zlib.crc32(bytes(buf[: SEG_HEADER.size - 4])) != crc:
            raise FormatError("segment header checksum mismatch", where, 0)
        if NewerFormat.is_newer(version, VERSIONS_READ):
            raise NewerFormat("segment header", version, VERSIONS_READ, segment=where, offset=0)
        if version not in VERSIONS_READ:
            raise FormatError(f"segment version {version} is none kvstore ever wrote (expected {VERSION})", where, 0)
        if flags & ~SEG_FLAGS_KNOWN:
            raise UnknownFlags(f"segment header has unknown flags 0x{flags:x}", where, 0)
        if tlen == 0 or tlen > 64:
            raise FormatError(f"segment tenant length {tlen} out of range 1-64", where, 0)
        return cls(seg_id, tenant[:tlen].decode("ascii"), bool(flags & SEG_FLAG_DIRECT), created)


# -- records ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FrameEntry:
    stored_len: int
    codec: int
    checksum: int


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A decoded record header. ``frames`` is empty for tombstones."""

    kind: int
    flags: int
    header_len: int
    payload_offset: int
    tenant: str
    key: str
    key_version: int
    frame_size: int
    logical_size: int
    payload_len: int
    record_len: int
    record_id: bytes
    created_ns: int
    frames: tuple[FrameEntry, ...]

    @property
    def sealed(self) -> bool:
        return bool(self.flags & REC_FLAG_SEALED)

    @property
    def is_tombstone(self) -> bool:
        return self.kind == KIND_TOMBSTONE

    @property
    def is_pad(self) -> bool:
        return self.kind == KIND_PAD

    def frame_offsets(self) -> list[int]:
        """Offset of each stored frame from the start of the payload."""
        out, pos = [], 0
        for f in self.frames:
            out.append(pos)
            pos += f.stored_len
        return out

    def frame_plain_len(self, i: int) -> int:
        if i < len(self.frames) - 1:
            return self.frame_size
        return self.logical_size - self.frame_size * (len(self.frames) - 1)

    def encode(self) -> bytes:
        """The header bytes, ``header_len`` long, with its checksum filled in."""
        t, k = self.tenant.encode(), self.key.encode()
        parts = [
            RECORD_HEADER.pack(
                REC_MAGIC,
                VERSION,
                self.kind,
                self.flags,
                self.header_len,
                self.payload_offset,
                len(t),
                0,
                len(k),
                self.key_version,
                self.frame_size,
                len(self.frames),
                self.logical_size,
                self.payload_len,
                self.record_len,
                self.record_id,
                self.created_ns,
                0,
            ),
            t,
            k,
        ]
        parts.extend(FRAME_ENTRY.pack(f.stored_len, f.codec, 0, f.checksum) for f in self.frames)
        raw = bytearray(b"".join(parts))
        struct.pack_into("<I", raw, _HEADER_CRC_AT, zlib.crc32(raw))
        return bytes(raw)

    @staticmethod
    def sizes(tenant: str, key: str, frame_count: int, payload_len: int, direct: bool) -> tuple[int, int, int]:
        """(header_len, payload_offset, record_len) for a record of this shape."""
        header_len = RECORD_HEADER.size + len(tenant) + len(key) + FRAME_ENTRY.size * frame_count
        payload_offset = align_up(header_len) if direct else header_len
        return header_len, payload_offset, align_up(payload_offset + payload_len)


def peek_header_len(buf: bytes | bytearray | memoryview, where: str = "", offset: int = 0) -> int:
    """Check the magic of a record at the start of ``buf``; return its header_len."""
    if len(buf) < RECORD_HEADER.size:
        raise FormatError("record header is truncated", where, offset)
    if bytes(buf[:4]) != REC_MAGIC:
        raise FormatError(f"bad record magic {bytes(buf[:4])!r}, expected {REC_MAGIC!r}", where, offset)
    (header_len,) = struct.unpack_from("<I", buf, 8)
    if header_len < RECORD_HEADER.size or header_len > MAX_HEADER_LEN:
        raise FormatError(f"record header_len {header_len} out of range", where, offset)
    return int(header_len)


def decode_record_header(buf: bytes | bytearray | memoryview, where: str = "", offset: int = 0) -> RecordHeader:
    """Decode and validate the record header at the start of ``buf``.

    ``buf`` must hold at least ``header_len`` bytes (see :func:`peek_header_len`).
    Raises :class:`FormatError` (or :class:`UnknownFlags`) naming the problem,
    :class:`NewerFormat` for an intact header of a later version.
    """
    header_len = peek_header_len(buf, where, offset)
    if len(buf) < header_len:
        raise FormatError(f"record header is truncated ({len(buf)} of {header_len} bytes)", where, offset)
    (
        _magic,
        version,
        kind,
        flags,
        _hl,
        payload_offset,
        tlen,
        _r,
        klen,
        key_version,
        frame_size,
        frame_count,
        logical_size,
        payload_len,
        record_len,
        record_id,
        created_ns,
        crc,
    ) = RECORD_HEADER.unpack_from(buf)
    raw = bytearray(buf[:header_len])
    struct.pack_into("<I", raw, _HEADER_CRC_AT, 0)
    if zlib.crc32(raw) != crc:
        raise FormatError("record header checksum mismatch", where, offset)
    if NewerFormat.is_newer(version, VERSIONS_READ):
        # A later release's record, whole: it must stop recovery, never pass
        # for a torn tail (cut off) or for corruption (skipped).
        raise NewerFormat("record", version, VERSIONS_READ, segment=where, offset=offset)
    if version not in VERSIONS_READ:
        raise FormatError(f"record version {version} is none kvstore ever wrote (expected {VERSION})", where, offset)
    if flags & ~REC_FLAGS_KNOWN:
        raise UnknownFlags(f"record has unknown flags 0x{flags:x}", where, offset)
    if kind not in (KIND_BLOCK, KIND_TOMBSTONE, KIND_PAD):
        raise FormatError(f"record kind {kind} is unknown", where, offset)
    expect_len = RECORD_HEADER.size + tlen + klen + FRAME_ENTRY.size * frame_count
    if header_len != expect_len:
        raise FormatError(f"record header_len {header_len} does not match its contents ({expect_len})", where, offset)
    if payload_offset < header_len or record_len < payload_offset + payload_len or record_len % ALIGN:
        raise FormatError("record lengths are inconsistent", where, offset)
    pos = RECORD_HEADER.size
    tenant = bytes(raw[pos : pos + tlen]).decode("ascii", "replace")
    pos += tlen
    key = bytes(raw[pos : pos + klen]).decode("ascii", "replace")
    pos += klen
    frames = []
    total = 0
    for _ in range(frame_count):
        stored_len, codec, _res, csum = FRAME_ENTRY.unpack_from(raw, pos)
        if codec not in CODECS_KNOWN:
            raise UnknownFlags(f"frame codec {codec} is unknown", where, offset)
        frames.append(FrameEntry(stored_len, codec, csum))
        total += stored_len
        pos += FRAME_ENTRY.size
    if total != payload_len:
        raise FormatError("frame lengths do not add up to payload_len", where, offset)
    expect_frames = -(-logical_size // frame_size) if frame_size else 0
    if kind == KIND_PAD and (frame_count or klen or payload_len):
        raise FormatError("a pad record has a key, frames or a payload", where, offset)
    if kind == KIND_BLOCK and (frame_count != expect_frames or frame_count == 0):
        raise FormatError("frame_count does not match logical_size / frame_size", where, offset)
    return RecordHeader(
        kind,
        flags,
        header_len,
        payload_offset,
        tenant,
        key,
        key_version,
        frame_size,
        logical_size,
        payload_len,
        record_len,
        bytes(record_id),
        created_ns,
        tuple(frames),
    )


# -- footer and trailer -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FooterEntry:
    """What the index needs to know of one record, as kept in a segment footer."""

    offset: int
    record_len: int
    logical_size: int
    created_ns: int
    record_id: bytes
    key_version: int
    payload_offset: int
    flags: int
    kind: int
    key: str


def encode_footer(entries: list[FooterEntry]) -> bytes:
    parts = []
    for e in entries:
        k = e.key.encode()
        parts.append(
            FOOTER_ENTRY.pack(
                e.offset,
                e.record_len,
                e.logical_size,
                e.created_ns,
                e.record_id,
                e.key_version,
                e.payload_offset,
                e.flags,
                e.kind,
                0,
                len(k),
            )
        )
        parts.append(k)
    return b"".join(parts)


def decode_footer(buf: bytes | bytearray | memoryview, count: int, where: str = "") -> list[FooterEntry]:
    out = []
    pos = 0
    for _ in range(count):
        if pos + FOOTER_ENTRY.size > len(buf):
            raise FormatError("footer is truncated", where, pos)
        off, rlen, lsize, created, rid, kver, poff, flags, kind, _r, klen = FOOTER_ENTRY.unpack_from(buf, pos)
        pos += FOOTER_ENTRY.size
        try:
            key = bytes(buf[pos : pos + klen]).decode("ascii")
        except UnicodeDecodeError:
            raise FormatError("footer entry key is not ASCII", where, pos) from None
        pos += klen
        out.append(FooterEntry(off, rlen, lsize, created, bytes(rid), kver, poff, flags, kind, key))
    if pos != len(buf):
        raise FormatError("footer has trailing bytes", where, pos)
    return out


@dataclass(frozen=True, slots=True)
class Trailer:
    footer_offset: int
    footer_len: int
    entry_count: int
    footer_checksum: int
    sealed_ns: int

    def encode(self) -> bytes:
        body = TRAILER.pack(
            TRAILER_MAGIC,
            self.footer_offset,
            self.footer_len,
            self.entry_count,
            self.footer_checksum,
            self.sealed_ns,
            0,
        )[:-4]
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview, where: str = "") -> Trailer:
        if len(buf) != TRAILER.size:
            raise FormatError("segment trailer is truncated", where)
        magic, foff, flen, count, fsum, sealed, crc = TRAILER.unpack(buf)
        if magic != TRAILER_MAGIC:
            raise FormatError("no segment trailer", where)
        if zlib.crc32(bytes(buf[:-4])) != crc:
            raise FormatError("segment trailer checksum mismatch", where)
        return cls(foff, flen, count, fsum, sealed)

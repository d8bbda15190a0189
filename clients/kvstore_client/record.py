"""Records as stored, opened here: the client side of ``GET /v1/records/{key}``.

The daemon sends the stored frames that cover the bytes asked for, as they
are on disk, after an envelope head (docs/API.md, "Records as stored")::

    magic     4 bytes   b"KVE1"
    meta_len  u32 LE
    meta      JSON      the frame table and, for a sealed tenant, the record's own key
    frames    the stored frames first..last, back to back

This module checks each frame exactly as the daemon would and decodes it
into the caller's buffer: its xxh3-64, then (sealed) AES-256-GCM under the
record's frame key with the nonce and additional data the daemon sealed it
with (record id, key version, frame index, frame count, size, tenant, key:
a frame of another record, index, tenant or key fails its tag), then its
codec (raw, zstd, or zstd over the two byte planes of 2-byte floats:
kvstore_client/wire/codec.py, as the daemon encoded it). A
frame that fails any check raises :class:`CorruptBlock`; nothing is returned.

Frames are independent: :meth:`RecordOpener.place` may run for several
frames on several threads at once (zstd, AES-GCM, xxhash and numpy's copies
release the GIL).
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
import threading
from dataclasses import dataclass
from typing import Any

import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore_client.errors import CorruptBlock, ProtocolError
from kvstore_client.wire.codec import CODECS, decode_frame
from kvstore_client.wire.errors import CorruptFrame
from kvstore_client.wire.sealing import TAG, FrameBinding, frame_nonce

MAGIC = b"KVE1"
HEAD = struct.Struct("<4sI")
MAX_META = 8 << 20  # a frame table of 64 MiB of 4 KiB frames is ~0.8 MiB of JSON
_local = threading.local()


@dataclass(frozen=True, slots=True)
class StoredFrame:
    length: int  # stored bytes
    codec: str
    xxh3: int


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """What opens frames ``first``.. of one record, and which block bytes
    ([start, end)) the caller wants from them."""

    tenant: str
    key: str
    size: int
    start: int
    end: int
    record_id: bytes
    key_version: int
    frame_size: int
    frame_count: int
    first: int
    frames: tuple[StoredFrame, ...]
    frame_key: bytes | None

    @property
    def stored_len(self) -> int:
        return sum(f.length for f in self.frames)

    def plain_bounds(self, j: int) -> tuple[int, int]:
        """Block bytes [lo, hi) that frame ``first + j`` holds."""
        lo = (self.first + j) * self.frame_size
        return lo, min(self.size, lo + self.frame_size)


def _field(doc: dict[str, Any], name: str, kind: type) -> Any:
    v = doc.get(name)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ProtocolError(f"record envelope: field {name!r} is missing or not {kind.__name__}")
    return v


def parse_meta(raw: bytes, key: str) -> RecordMeta:
    """The envelope's meta, checked for consistency; ``key`` is the key asked
    for (a record of another key is corrupt, whatever its frames say)."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ProtocolError(f"record envelope: bad JSON: {e}") from None
    return meta_of(doc, key)


def meta_of(doc: Any, key: str) -> RecordMeta:
    """:func:`parse_meta` of meta already parsed (a read plan's ``record``)."""
    if not isinstance(doc, dict):
        raise ProtocolError("record envelope: meta is not an object")
    if _field(doc, "key", str) != key:
        raise CorruptBlock(f"asked for block {key} but the daemon sent a record of {doc['key']!r}")
    frames = []
    for f in _field(doc, "frames", list):
        if not isinstance(f, dict):
            raise ProtocolError("record envelope: a frame entry is not an object")
        codec = _field(f, "codec", str)
        if codec not in CODECS:
            raise ProtocolError(f"record envelope: unknown frame codec {codec!r} (a newer daemon: upgrade the client)")
        try:
            digest = int(_field(f, "xxh3", str), 16)
        except ValueError:
            raise ProtocolError("record envelope: a frame's xxh3 is not hex") from None
        frames.append(StoredFrame(_field(f, "len", int), codec, digest))
    fk = doc.get("frame_key")
    try:
        frame_key = None if fk is None else base64.b64decode(str(fk), validate=True)
        record_id = bytes.fromhex(_field(doc, "record_id", str))
    except (ValueError, binascii.Error):
        raise ProtocolError("record envelope: frame_key or record_id is not well formed") from None
    meta = RecordMeta(
        _field(doc, "tenant", str),
        key,
        _field(doc, "size", int),
        _field(doc, "start", int),
        _field(doc, "end", int),
        record_id,
        _field(doc, "key_version", int),
        _field(doc, "frame_size", int),
        _field(doc, "frame_count", int),
        _field(doc, "first", int),
        tuple(frames),
        frame_key,
    )
    _check_layout(meta, bool(doc.get("sealed")))
    return meta


def _check_layout(m: RecordMeta, sealed: bool) -> None:
    problem = None
    if sealed != (m.frame_key is not None) or (m.frame_key is not None and len(m.frame_key) != 32):
        problem = "a sealed record needs a 32-byte frame key, and only a sealed one has one"
    elif len(m.record_id) != 16 or m.frame_size <= 0 or m.size <= 0:
        problem = "record id, frame size or size out of range"
    elif m.frame_count != -(-m.size // m.frame_size):
        problem = f"{m.frame_count} frames cannot hold {m.size} bytes in frames of {m.frame_size}"
    elif not 0 <= m.start < m.end <= m.size:
        problem = f"range [{m.start}, {m.end}) is not within {m.size} bytes"
    elif m.first != m.start // m.frame_size or m.first + len(m.frames) - 1 != (m.end - 1) // m.frame_size:
        problem = "the frames sent do not cover the range"
    if problem:
        raise ProtocolError(f"record envelope of block {m.key}: {problem}")


class RecordOpener:
    """Checks and decodes the frames of one record (``meta``) into ``out``,
    which holds block bytes [meta.start, meta.end)."""

    def __init__(self, meta: RecordMeta, out: memoryview) -> None:
        self.meta = meta
        self._out = out
        self._aead = AESGCM(meta.frame_key) if meta.frame_key is not None else None
        self._binding = FrameBinding(
            meta.record_id, meta.key_version, meta.frame_count, meta.size, meta.tenant, meta.key
        )

    def place(self, j: int, stored: bytes | bytearray | memoryview) -> None:
        """Check frame ``first + j`` (its stored bytes) and put its part of
        [start, end) into the output."""
        m = self.meta
        sf = m.frames[j]
        if len(stored) != sf.length:
            raise ProtocolError(f"block {m.key}: frame {m.first + j} is {len(stored)} bytes, expected {sf.length}")
        if xxhash.xxh3_64_intdigest(stored) != sf.xxh3:
            raise CorruptBlock(f"block {m.key}: frame {m.first + j} fails its checksum")
        f_lo, f_hi = m.plain_bounds(j)
        lo, hi = max(m.start, f_lo), min(m.end, f_hi)
        if lo == f_lo and hi == f_hi:
            self._open(j, memoryview(stored), self._out[lo - m.start : hi - m.start])
            return
        whole = bytearray(f_hi - f_lo)
        self._open(j, memoryview(stored), memoryview(whole))
        self._out[lo - m.start : hi - m.start] = memoryview(whole)[lo - f_lo : hi - f_lo]

    def _open(self, j: int, stored: memoryview, out: memoryview) -> None:
        codec = self.meta.frames[j].codec
        if self._aead is not None:
            n = len(stored) - TAG
            if n < 0:
                raise CorruptBlock(f"block {self.meta.key}: frame {self.meta.first + j} is shorter than its tag")
            plain = out if codec == "raw" and n == len(out) else _scratch(n)
            i = self.meta.first + j
            try:
                self._aead.decrypt_into(frame_nonce(i), stored, self._binding.aad(i), plain)
            except InvalidTag:
                raise CorruptBlock(f"block {self.meta.key}: frame {i} fails authentication (AES-GCM tag)") from None
            if plain is out:
                return
            stored = plain
        try:
            decode_frame(codec, stored, out)
        except CorruptFrame as e:
            raise CorruptBlock(f"block {self.meta.key}: frame {self.meta.first + j}: {e}") from None


def _scratch(n: int) -> memoryview:
    """A per-thread buffer of ``n`` bytes, reused (decrypted frames before decoding)."""
    buf: bytearray | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = bytearray(max(n, 1 << 20))
    return memoryview(buf)[:n]

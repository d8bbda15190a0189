"""The record envelope: a record as stored, as ``GET /v1/records/{key}``
sends it (docs/API.md, "Records as stored"), written once for the daemon
that sends it and the client that opens it::

    magic     4 bytes   b"KVE1"
    meta_len  u32 LE    bytes of meta
    meta      JSON      what opens the frames (:func:`meta_doc`)
    frames    bytes     the stored frames first..last, back to back

A read plan's ``record`` is the meta alone. Clients of other releases read
these bytes: the meta's fields keep their names and order, and
tests/unit/test_envelope.py pins them. A magic ``KVE`` + another version is
a later release's envelope (:class:`~.errors.NewerEnvelope`: upgrade the
client).

Parsing checks the meta for consistency (the frames cover the range, a
sealed record and only a sealed one has a 32-byte key) and raises
:class:`~.errors.BadEnvelope`, or :class:`~.errors.OtherRecord` for a
record of another key than asked for; the client maps these to its own
errors in one place (kvstore_client/record.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from dataclasses import dataclass
from typing import Any

from kvstore_client.wire.codec import CODECS
from kvstore_client.wire.errors import BadEnvelope, NewerEnvelope, OtherRecord

MAGIC = b"KVE1"
HEAD = struct.Struct("<4sI")  # magic, meta_len
MAX_META = 8 << 20  # a frame table of 64 MiB of 4 KiB frames is ~0.8 MiB of JSON
KEY_BYTES = 32  # a sealed record's frame key (AES-256)


@dataclass(frozen=True, slots=True)
class StoredFrame:
    length: int  # stored bytes
    codec: str
    xxh3: int


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """What opens frames ``first``.. of one record, and which block bytes
    ([start, end)) the caller wants from them. ``frame_key`` is the record's
    own key for a sealed record (never the tenant's data key), None for a
    direct one."""

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


# -- writing (the daemon) ----------------------------------------------------------------


def meta_doc(m: RecordMeta) -> dict[str, Any]:
    """The meta as JSON sends it, its fields in their wire order."""
    return {
        "tenant": m.tenant,
        "key": m.key,
        "size": m.size,
        "start": m.start,
        "end": m.end,
        "record_id": m.record_id.hex(),
        "key_version": m.key_version,
        "frame_size": m.frame_size,
        "frame_count": m.frame_count,
        "first": m.first,
        "frames": [{"len": f.length, "codec": f.codec, "xxh3": f"{f.xxh3:016x}"} for f in m.frames],
        "sealed": m.frame_key is not None,
        "frame_key": None if m.frame_key is None else base64.b64encode(m.frame_key).decode(),
    }


def pack_head(doc: dict[str, Any]) -> bytes:
    """Magic, meta length and the meta (:func:`meta_doc`): what precedes the frames."""
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return HEAD.pack(MAGIC, len(raw)) + raw


# -- reading (the client) ----------------------------------------------------------------


def meta_len(head: bytes) -> int:
    """The meta's length that the envelope's first :data:`HEAD` bytes give,
    once the magic is this release's and the length within :data:`MAX_META`."""
    magic, n = HEAD.unpack(head)
    if magic != MAGIC and magic[:3] == MAGIC[:3]:
        raise NewerEnvelope(
            f"record envelope {magic!r} is a newer daemon's; this client reads {MAGIC!r} only: upgrade kvstore-client"
        )
    if magic != MAGIC or n > MAX_META:
        raise BadEnvelope("not a record envelope")
    return int(n)


def parse_meta(raw: bytes, key: str) -> RecordMeta:
    """The envelope's meta, checked for consistency; ``key`` is the key asked
    for (a record of another key is corrupt, whatever its frames say)."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise BadEnvelope(f"record envelope: bad JSON: {e}") from None
    return meta_of(doc, key)


def meta_of(doc: Any, key: str) -> RecordMeta:
    """:func:`parse_meta` of meta already parsed (a read plan's ``record``)."""
    if not isinstance(doc, dict):
        raise BadEnvelope("record envelope: meta is not an object")
    if _field(doc, "key", str) != key:
        raise OtherRecord(f"asked for block {key} but the daemon sent a record of {doc['key']!r}")
    frames = tuple(_frame(f) for f in _field(doc, "frames", list))
    fk = doc.get("frame_key")
    try:
        frame_key = None if fk is None else base64.b64decode(str(fk), validate=True)
        record_id = bytes.fromhex(_field(doc, "record_id", str))
    except (ValueError, binascii.Error):
        raise BadEnvelope("record envelope: frame_key or record_id is not well formed") from None
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
        frames,
        frame_key,
    )
    _check_layout(meta, bool(doc.get("sealed")))
    return meta


def _field(doc: dict[str, Any], name: str, kind: type) -> Any:
    v = doc.get(name)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise BadEnvelope(f"record envelope: field {name!r} is missing or not {kind.__name__}")
    return v


def _frame(f: Any) -> StoredFrame:
    """One entry of the meta's frame table."""
    if not isinstance(f, dict):
        raise BadEnvelope("record envelope: a frame entry is not an object")
    codec = _field(f, "codec", str)
    if codec not in CODECS:
        raise BadEnvelope(f"record envelope: unknown frame codec {codec!r} (a newer daemon: upgrade the client)")
    try:
        digest = int(_field(f, "xxh3", str), 16)
    except ValueError:
        raise BadEnvelope("record envelope: a frame's xxh3 is not hex") from None
    return StoredFrame(_field(f, "len", int), codec, digest)


def _check_layout(m: RecordMeta, sealed: bool) -> None:
    problem = None
    if sealed != (m.frame_key is not None) or (m.frame_key is not None and len(m.frame_key) != KEY_BYTES):
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
        raise BadEnvelope(f"record envelope of block {m.key}: {problem}")

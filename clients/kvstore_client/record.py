"""Records as stored, opened here: the client side of ``GET /v1/records/{key}``.

The daemon sends the stored frames that cover the bytes asked for, as they
are on disk, after an envelope head (docs/API.md, "Records as stored";
its format: kvstore_client/wire/envelope.py, whose errors become the
client's here, in :func:`client_errors`).

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

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore_client.errors import CorruptBlock, ProtocolError
from kvstore_client.wire import envelope
from kvstore_client.wire.codec import decode_frame
from kvstore_client.wire.envelope import RecordMeta as RecordMeta
from kvstore_client.wire.envelope import StoredFrame as StoredFrame
from kvstore_client.wire.errors import BadEnvelope, CorruptFrame, OtherRecord
from kvstore_client.wire.sealing import TAG, FrameBinding, frame_nonce

_local = threading.local()


def parse_meta(raw: bytes, key: str) -> RecordMeta:
    """:func:`kvstore_client.wire.envelope.parse_meta`, with the client's errors."""
    with client_errors():
        return envelope.parse_meta(raw, key)


def meta_of(doc: Any, key: str) -> RecordMeta:
    """:func:`kvstore_client.wire.envelope.meta_of` (a read plan's ``record``), with the client's errors."""
    with client_errors():
        return envelope.meta_of(doc, key)


@contextmanager
def client_errors(where: str = "", status: int | None = None) -> Iterator[None]:
    """The envelope's errors as the client's, in one place: a record of
    another key is corrupt, anything else that breaks the envelope a
    protocol error. ``where`` prefixes the message (the block, say)."""
    try:
        yield
    except OtherRecord as e:
        raise CorruptBlock(f"{where}{e}", status=status) from None
    except BadEnvelope as e:
        raise ProtocolError(f"{where}{e}", status=status) from None


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

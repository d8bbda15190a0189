"""How a sealed record's frames are bound to it: each frame's AES-256-GCM
nonce and additional data (docs: kvstore/engine/format.py, "Nonces"),
written once for the daemon that seals and opens frames and for a client
that opens or seals them itself.

Frame ``i`` of a record is sealed under the record's frame key (HKDF of the
tenant's data key with the record id as salt: never given out) with nonce
``i`` (96-bit big-endian) and additional data binding the record id, the
key version, ``i``, the frame count, the block's size, the tenant and the
key: a frame moved to another index, record, tenant or key, or a record
cut short, fails its tag.

Everything else sealed (a wrapped data key, an S3 secret, an ident, a
gateway record) and the frame key's derivation are bound the same way, by
:func:`aad`: a label naming what is sealed, then its parts, each after a
NUL byte. The bytes are on disk and in buckets: tests/unit/test_aad.py pins
them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

TAG = 16  # the GCM tag each sealed frame ends with
_AAD_FIXED = struct.Struct("<16sIIIQ")  # record id, key version, frame index, frame count, size


def aad(label: bytes, *parts: str | int) -> bytes:
    """``label``, then each part (text as UTF-8, an integer in decimal) after
    a NUL byte. The label says what is bound, so additional data made for one
    kind of secret never opens another; parts never hold NUL (tenant names
    and keys cannot, by their grammars), so the parts are unambiguous."""
    return label + b"".join(b"\x00" + str(part).encode() for part in parts)


def frame_nonce(index: int) -> bytes:
    return index.to_bytes(12, "big")


@dataclass(frozen=True, slots=True)
class FrameBinding:
    """What the frames of one record are bound to."""

    record_id: bytes
    key_version: int
    frame_count: int
    size: int  # the block's plaintext bytes
    tenant: str
    key: str

    def aad(self, index: int) -> bytes:
        """The additional data of frame ``index``."""
        fixed = _AAD_FIXED.pack(self.record_id, self.key_version, index, self.frame_count, self.size)
        return aad(fixed, self.tenant, self.key)

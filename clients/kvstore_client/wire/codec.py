"""Frame codecs: how one stored frame holds its plaintext (``pip install 'kvstore-client[decode]'``).

The daemon encodes each frame of a record as it stores it; whoever reads
the frame as stored (the daemon, or the client with ``decode="client"``)
decodes it here. Codecs are named as docs/API.md names them (the record
envelope's ``codec``); the daemon stores them as ids (kvstore/engine/format.py).

- ``raw``: the plaintext as it is.
- ``zstd``: one zstd frame.
- ``zstd-bp2``: zstd over the two byte planes of 2-byte floats. KV caches
  in bf16/fp16 compress poorly as a byte stream (~1.28x bf16, ~1.09x fp16 at
  zstd -1): the mantissa byte is noise. Each 2-byte value is split into its
  high byte (sign + exponent: compresses ~2.5x) and low byte (the mantissa:
  1.00-1.02x), and each plane is compressed on its own; the low plane is kept
  only if zstd saves at least 1% on it, else stored raw (measured on the real
  KV samples: 1.478x bf16, 1.18x fp16 end to end). Layout::

    u32 high_len            bytes of the zstd frame of the high plane
    u32 low_len | LOW_ZSTD  bytes of the low plane as stored; top bit: zstd
    high plane (zstd)
    low plane (zstd or raw)
    the odd trailing byte of an odd-length frame, if any

A frame that does not shrink is stored raw, so incompressible data costs
nothing on reads. Decoding checks every length against the plaintext's
(``out``): a frame that does not decode to exactly it raises
:class:`~kvstore_client.wire.errors.CorruptFrame`. The caller checks the
frame's checksum (and tag) before.

Frames are independent: zstd, numpy's copies and this module's per-thread
(de)compressors let several threads encode or decode at once.
"""

from __future__ import annotations

import struct
import threading
from typing import Literal

import numpy as np
import zstandard

from kvstore_client.wire.errors import CorruptFrame

Codec = Literal["raw", "zstd", "zstd-bp2"]
CODECS: frozenset[str] = frozenset({"raw", "zstd", "zstd-bp2"})
MIN_COMPRESSED = 64  # frames shorter than this are stored raw

_BP2 = struct.Struct("<II")  # high plane length, low plane length | _LOW_ZSTD
_LOW_ZSTD = 1 << 31
_local = threading.local()  # zstd (de)compressor objects are not thread-safe


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("c", {})
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False)
    return c


# zstd's level 1 searches matches of 6 bytes or more in a 128 KiB+ window.
# On a high byte plane with few distinct values (bf16: sign and exponent, 15-20
# values in 8 KiB of real KV) that search is most of the encode time; matches
# of 7 bytes or more in a 32 KiB window, one probe each, give the same ratio
# or better at about twice the speed (bf16: 0.19 -> 0.37 GB/s per core,
# 2.62x -> 2.73x on the plane). On fp16's high plane (sign, exponent and two
# mantissa bits: ~100 values) they are slower, so a probe of each frame picks:
# the distinct values among its first PROBE_BYTES high bytes. Either way the
# frames are ordinary zstd frames: readers need nothing new.
_FEW_VALUES_LEVEL1 = zstandard.ZstdCompressionParameters(
    window_log=15,
    hash_log=9,
    chain_log=9,
    search_log=1,
    min_match=7,
    strategy=zstandard.STRATEGY_FAST,
    write_checksum=False,
)
PROBE_BYTES = 8192
FEW_VALUES = 48


def _plane_compressor(plane: np.ndarray, level: int) -> zstandard.ZstdCompressor:
    """The compressor of byte plane ``plane`` at ``level`` (see _FEW_VALUES_LEVEL1)."""
    if level != 1 or int(np.count_nonzero(np.bincount(plane[:PROBE_BYTES], minlength=256))) > FEW_VALUES:
        return _compressor(level)
    c: zstandard.ZstdCompressor | None = getattr(_local, "few1", None)
    if c is None:
        c = _local.few1 = zstandard.ZstdCompressor(compression_params=_FEW_VALUES_LEVEL1)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def encode_frame(plain: memoryview, codec: Codec, level: int) -> tuple[Codec, bytes | memoryview]:
    """(the codec used, the stored bytes) of one frame of plaintext, with
    ``codec`` at zstd ``level``, or raw where that does not shrink it."""
    n = len(plain)
    if codec == "raw" or n < MIN_COMPRESSED:
        return "raw", plain
    if codec == "zstd":
        out = _compressor(level).compress(plain)
        return ("zstd", out) if len(out) < n else ("raw", plain)
    # The planes by shifts of little-endian 2-byte values: a third of the time
    # of gathering every other byte (a strided copy).
    values = np.frombuffer(plain, dtype="<u2", count=n // 2)
    high_plane = (values >> 8).astype(np.uint8)
    low_raw = values.astype(np.uint8).data  # the low byte
    high = _plane_compressor(high_plane, level).compress(high_plane.data)
    low: bytes | memoryview = _compressor(level).compress(low_raw)
    low_flag = _LOW_ZSTD
    if len(low) * 100 > len(low_raw) * 99:  # saves under 1%: not worth decoding
        low, low_flag = low_raw, 0
    stored_len = _BP2.size + len(high) + len(low) + (n & 1)
    if stored_len >= n:
        return "raw", plain
    tail = bytes(plain[-1:]) if n & 1 else b""
    return "zstd-bp2", b"".join((_BP2.pack(len(high), len(low) | low_flag), high, low, tail))


def decode_frame(codec: str, stored: memoryview, out: memoryview) -> None:
    """Decode one stored (opened) frame into ``out``, exactly its plaintext."""
    n = len(out)
    if codec == "raw":
        if len(stored) != n:
            raise CorruptFrame(f"raw frame is {len(stored)} bytes, expected {n}")
        out[:] = stored
        return
    try:
        if codec == "zstd":
            plain = _decompressor().decompress(stored, max_output_size=n)
            if len(plain) != n:
                raise CorruptFrame(f"frame decompressed to {len(plain)} bytes, expected {n}")
            out[:] = plain
            return
        if codec != "zstd-bp2":
            raise CorruptFrame(f"unknown frame codec {codec!r}")
        hlen, lword = _BP2.unpack_from(stored)
        llen, pairs = lword & ~_LOW_ZSTD, n // 2
        low_at = _BP2.size + hlen
        if low_at + llen + (n & 1) != len(stored):
            raise CorruptFrame("byte-plane frame lengths are inconsistent")
        dz = _decompressor()
        high = dz.decompress(stored[_BP2.size : low_at], max_output_size=pairs)
        low: bytes | memoryview = stored[low_at : low_at + llen]
        if lword & _LOW_ZSTD:
            low = dz.decompress(low, max_output_size=pairs)
        if len(high) != pairs or len(low) != pairs:
            raise CorruptFrame("byte-plane frame planes have the wrong length")
        dst = np.frombuffer(out, dtype="<u2", count=pairs)
        np.left_shift(np.frombuffer(high, dtype=np.uint8), 8, out=dst, dtype=np.uint16)
        np.bitwise_or(dst, np.frombuffer(low, dtype=np.uint8), out=dst)
        if n & 1:
            out[-1] = stored[-1]
    except (zstandard.ZstdError, struct.error) as e:
        raise CorruptFrame(f"frame does not decode: {e}") from None

"""Per-frame compression as the engine stores it: the frame codecs of
kvstore_client/wire/codec.py (written once, for the daemon that encodes and
for whoever decodes), with the engine's codec ids and errors.

``compression`` ("none", "zstd", "zstd-bp2": kvstore.config) names the codec
to try; a frame that does not shrink is stored raw. The id a frame is stored
with is in its segment's frame table (kvstore/engine/format.py, CODEC_NAMES);
a frame that does not decode is :class:`~kvstore.errors.CorruptionError`.
"""

from __future__ import annotations

from kvstore_client.wire import codec as wire
from kvstore_client.wire.errors import CorruptFrame

from kvstore.config import Compression
from kvstore.engine.format import CODEC_NAMES
from kvstore.errors import CorruptionError

_IDS = {name: codec_id for codec_id, name in CODEC_NAMES.items()}
_TRIED: dict[Compression, wire.Codec] = {"none": "raw", "zstd": "zstd", "zstd-bp2": "zstd-bp2"}


def encode_frame(plain: memoryview, compression: Compression, level: int) -> tuple[int, bytes | memoryview]:
    """Return (codec id, stored bytes) for one frame of plaintext."""
    name, stored = wire.encode_frame(plain, _TRIED[compression], level)
    return _IDS[name], stored


def decode_frame(codec: int, stored: memoryview, out: memoryview) -> None:
    """Decode one stored frame into ``out`` (exactly the frame's plaintext length)."""
    name = CODEC_NAMES.get(codec)
    if name is None:
        raise CorruptionError(f"unknown frame codec {codec}")
    try:
        wire.decode_frame(name, stored, out)
    except CorruptFrame as e:
        raise CorruptionError(str(e)) from None

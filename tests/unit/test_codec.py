"""codec.py: lossless on any bytes; the byte-plane split pays on real bf16/fp16 KV."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.config import COMPRESSIONS
from kvstore.engine.codec import decode_frame, encode_frame
from kvstore.engine.format import CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_BP2
from tests.conftest import kv_sample


def _round_trip(data: bytes, compression: str) -> tuple[int, int]:
    codec, stored = encode_frame(memoryview(data), compression, 1)  # type: ignore[arg-type]
    out = bytearray(len(data))
    decode_frame(codec, memoryview(stored), memoryview(out))
    assert out == data
    return codec, len(stored)


@given(st.binary(min_size=1, max_size=5000), st.sampled_from(COMPRESSIONS))
def test_round_trip_any_bytes(data: bytes, compression: str) -> None:
    _, stored_len = _round_trip(data, compression)
    assert stored_len <= len(data)  # never grows: raw fallback


@pytest.mark.parametrize("n", [64, 65, 4095, 4096, 4097, 1 << 20])
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_round_trip_sizes(n: int, compression: str) -> None:
    kv = kv_sample("gemma3-270m.bf16.layers8-9.bin")
    _round_trip(kv[:n], compression)
    _round_trip(bytes(n), compression)


def test_incompressible_is_stored_raw() -> None:
    codec, stored_len = _round_trip(os.urandom(1 << 16), "zstd-bp2")
    assert codec == CODEC_RAW and stored_len == 1 << 16


def _ratio(data: bytes, compression: str, frame: int = 1 << 20) -> float:
    stored = 0
    for i in range(0, len(data), frame):
        stored += _round_trip(data[i : i + frame], compression)[1]
    return len(data) / stored


def test_byte_plane_split_pays_on_real_kv() -> None:
    """Measured on real KV caches (see tests/data/kv/README.md)."""
    bf16 = kv_sample("minilm-l6-v2.bf16.first2MiB.bin")
    f16 = kv_sample("minilm-l6-v2.f16.first2MiB.bin")
    assert _ratio(bf16, "zstd-bp2") > 1.45 > _ratio(bf16, "zstd")
    assert _ratio(f16, "zstd-bp2") > 1.15 > _ratio(f16, "zstd")
    codec, _ = encode_frame(memoryview(bf16[: 1 << 20]), "zstd-bp2", 1)
    assert codec == CODEC_ZSTD_BP2
    codec, _ = encode_frame(memoryview(bf16[: 1 << 20]), "zstd", 1)
    assert codec == CODEC_ZSTD

"""kvstore-bench soak's workload, its pure parts: a block's bytes follow from
its key alone (so a read is checked without keeping the blocks), wrong bytes
are counted, and a keeping tenant's window says which misses are losses."""

from __future__ import annotations

import random

from kvstore_bench.soak_load import (
    MAX_BLOCK,
    MIN_BLOCK,
    Keys,
    block_seed,
    block_size,
    payload,
    tenant_specs,
    wrong_bytes,
)


def test_a_blocks_bytes_follow_from_its_key() -> None:
    a = payload(1, "sealed", 7)
    assert a == payload(1, "sealed", 7)
    assert a != payload(2, "sealed", 7) and a != payload(1, "direct", 7) and a != payload(1, "sealed", 8)
    assert max(a) < 64  # 6 random bits a byte: compressible, as KV caches are somewhat


def test_block_sizes_span_4_kib_to_1_mib() -> None:
    sizes = [block_size(block_seed(1, "t", n)) for n in range(2000)]
    assert MIN_BLOCK <= min(sizes) < 8 << 10 and 512 << 10 < max(sizes) <= MAX_BLOCK
    assert any(s % 4096 for s in sizes)  # not only page multiples


def test_wrong_bytes_counts_each_byte_and_the_length() -> None:
    want = payload(1, "t", 1)
    assert wrong_bytes(want, want) == 0
    got = bytearray(want)
    got[0] ^= 1
    got[100] ^= 1
    assert wrong_bytes(bytes(got), want) == 2
    assert wrong_bytes(want[:-10], want) == 10


def test_a_keeping_tenant_knows_which_blocks_must_be_there() -> None:
    spec = next(s for s in tenant_specs("") if s.keep)
    keys = Keys(spec, window=4)
    ns = keys.claim(6)
    assert not any(keys.stored(n) for n in ns)  # being written
    for n in ns:
        keys.written(n, ok=n != 5)
    assert [keys.stored(n) for n in ns] == [True] * 5 + [False]  # 5 failed: not owed
    assert keys.trim() == [0, 1]  # slid out of the window
    assert not keys.stored(0) and keys.stored(2)
    rng = random.Random(0)
    assert all(2 <= (keys.pick(rng) or 0) < 6 for _ in range(100))


def test_an_evicting_tenant_owes_nothing() -> None:
    spec = next(s for s in tenant_specs("") if not s.keep)
    keys = Keys(spec, window=4)
    for n in keys.claim(10):
        keys.written(n, ok=True)
    assert keys.trim() == [] and not any(keys.stored(n) for n in range(10))

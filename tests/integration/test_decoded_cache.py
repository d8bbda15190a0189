"""The decoded-blocks cache (kvstore/engine/decoded.py) on a real store: hot
sealed blocks skip the codec, every answer stays exactly the block's bytes
(whole and ranged, through compaction and rewrites), a caller's copy never
reaches the cache, key rotation and tenant deletion drop a tenant's
plaintext, and the cache stays within its bound and a tenant within its share."""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.decoded import TENANT_SHARE
from kvstore.engine.store import Store
from tests.integration.test_store_roundtrip import block

FS = 64 * 1024


def cfg(data_dir: Path, cache: str = "4MiB") -> StoreConfig:
    return StoreConfig.from_env(
        data_dir, env={}, segment_size="1MiB", frame_size="64KiB", max_block_size="4MiB", decoded_cache_bytes=cache
    )


def hits(store: Store) -> tuple[float, float]:
    m = store.metrics
    return m.counter("kvstore_decoded_cache_hits_total"), m.counter("kvstore_decoded_cache_misses_total")


async def test_hot_sealed_blocks_skip_the_codec_and_stay_exact(tmp_path: Path) -> None:
    store = await Store.open(cfg(tmp_path), MasterKey(os.urandom(32)))
    try:
        await store.create_tenant("s")
        await store.create_tenant("z", "sealed", "zstd")
        data = {(t, f"k{i}"): block(f"{t}{i}", 150_000 + i) for t in ("s", "z") for i in range(3)}
        for (t, k), v in data.items():
            await store.put(t, k, v)
        for (t, k), v in data.items():
            assert await store.get(t, k) == v
        assert hits(store) == (0, 6)
        for (t, k), v in data.items():
            got = await store.get(t, k)
            assert got == v
            got[:10] = b"x" * 10  # the caller's copy: never the cached buffer
            for lo, hi in ((0, 1), (FS - 3, FS + 3), (2 * FS, 150_000), (149_999, 150_000)):
                assert await store.get_range(t, k, lo, hi) == v[lo:hi], (t, k, lo, hi)
                view = await store.get_buffer(t, k, lo, hi)
                assert isinstance(view, memoryview) and view.readonly and view == v[lo:hi]
        h, m = hits(store)
        assert m == 6 and h == 6 * 9, (h, m)
        assert sum(store.decoded.held().values()) == sum(len(v) for v in data.values()) == store.decoded.size
        # Compaction moves records (same record, same bytes): answers stay exact, and cached.
        for i in (0, 1):
            await store.delete("s", f"k{i}")
            del data[("s", f"k{i}")]
        await store.compact("s")
        assert await store.get("s", "k2") == data[("s", "k2")]
        # A key written again after a delete is another record: its new bytes, not the cached ones.
        await store.put("s", "k0", b"new bytes" * 1000)
        assert await store.get("s", "k0") == b"new bytes" * 1000
    finally:
        await store.close()


async def test_rotation_and_deletion_drop_a_tenants_plaintext(tmp_path: Path) -> None:
    store = await Store.open(cfg(tmp_path), MasterKey(os.urandom(32)))
    try:
        for t in ("a", "b"):
            await store.create_tenant(t)
            await store.put(t, "k", block(t, 200_000))
            await store.get(t, "k")
        assert set(store.decoded.held()) == {"a", "b"}
        await store.rotate_tenant_key("a")
        assert set(store.decoded.held()) == {"b"}
        assert await store.get("a", "k") == block("a", 200_000)  # decoded again, with the old key version
        await store.delete_tenant("b")
        assert set(store.decoded.held()) == {"a"}
        await store.create_tenant("b")
        await store.put("b", "k", block("b2", 200_000))
        assert await store.get("b", "k") == block("b2", 200_000)
        # A reader worker learns of a rotation from the registry: its cached
        # blocks of that tenant no longer match the tenant's key version.
        generation = (store._tenant("a").created_ns, store._tenant("a").key_version)
        assert store.decoded.get("a", (generation[0], generation[1] + 1), b"x" * 16) is None
        assert "a" not in store.decoded.held()
    finally:
        await store.close()


async def test_bounded_and_no_tenant_over_its_share(tmp_path: Path) -> None:
    master = MasterKey(os.urandom(32))
    store = await Store.open(cfg(tmp_path, "1MiB"), master)
    try:
        await store.create_tenant("hog")
        await store.create_tenant("quiet")
        await store.put("quiet", "q", block("q", 200_000))
        await store.get("quiet", "q")
        for i in range(12):
            v = block(f"h{i}", 150_000)
            await store.put("hog", f"h{i}", v)
            assert await store.get("hog", f"h{i}") == v
            assert store.decoded.size <= store.decoded.capacity
            assert store.decoded.held().get("hog", 0) <= store.decoded.capacity * TENANT_SHARE
        assert store.decoded.held()["quiet"] == 200_000  # the hog evicted its own, not the quiet tenant's
        assert store.metrics.counter("kvstore_decoded_cache_evictions_total") > 0
    finally:
        await store.close()
    off = await Store.open(cfg(tmp_path, "0"), master)
    try:
        assert not off.decoded.enabled
    finally:
        await off.close()


def test_a_dropped_tenants_gauge_goes_to_zero() -> None:
    from kvstore.engine.decoded import DecodedCache
    from kvstore.metrics import Metrics

    cache = DecodedCache(1 << 20, Metrics())
    cache.put("a", (1, 1), b"r" * 16, b"x" * 1000)
    cache.put("b", (1, 1), b"r" * 16, b"y" * 10)
    assert cache.gauges() == {"a": 1000, "b": 10}
    cache.drop_tenant("a")
    assert cache.gauges() == {"a": 0, "b": 10}
    assert cache.gauges() == {"b": 10}

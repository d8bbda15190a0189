"""A block removed for any reason is never served again: after a restart,
an index rebuild, or a rebuild of the node from its bucket (that one in
test_g4.py, beside its fixtures).

Regression (issue 24, item 2): quota evictions and TTL removals wrote no
record; an index rebuild (index directory deleted, restart) replayed the
segments and served every evicted block again, with its old bytes.
"""

from __future__ import annotations

import asyncio
import random
import shutil

from kvstore.config import StoreConfig
from kvstore.engine.store import Store
from tests.conftest import OpenStore

KiB = 1024


def block(key: str, size: int = 64 * KiB) -> bytes:
    return random.Random(key).randbytes(size)


async def present(store: Store, tenant: str, keys: list[str]) -> set[str]:
    return {k for k, here in zip(keys, await store.present(tenant, keys), strict=True) if here}


async def test_quota_evictions_stay_gone_after_an_index_rebuild(open_store: OpenStore, config: StoreConfig) -> None:
    store = await open_store()
    for policy in ("direct", "sealed"):
        await store.create_tenant(policy, policy, quota_bytes=512 * KiB)
    keys = [f"k{i:02d}" for i in range(40)]  # 2.5 MiB through a 512 KiB quota
    for tenant in ("direct", "sealed"):
        for k in keys:
            await store.put(tenant, k, block(f"{tenant}/{k}"))
    kept = {t: await present(store, t, keys) for t in ("direct", "sealed")}
    for t, here in kept.items():
        assert 0 < len(here) < len(keys) // 2, f"{t}: the quota evicted nothing, or everything"
    await store.close()

    shutil.rmtree(config.data_dir / "index")  # an index rebuild, from the segments alone
    store = await open_store()
    assert store.recovery.index_rebuilt
    for t, here in kept.items():
        assert await present(store, t, keys) == here, f"{t}: evicted blocks came back after an index rebuild"
        for k in here:
            assert await store.get(t, k) == block(f"{t}/{k}")
    # Compaction still gives the evicted blocks' space back, and they stay gone.
    await store.compact()
    await store.close()
    shutil.rmtree(config.data_dir / "index")
    store = await open_store()
    for t, here in kept.items():
        assert await present(store, t, keys) == here


async def test_expired_blocks_stay_gone_when_the_ttl_is_lifted_and_the_index_rebuilt(
    open_store: OpenStore, config: StoreConfig
) -> None:
    store = await open_store()
    await store.create_tenant("t", ttl_s=1)
    old = [f"old{i}" for i in range(6)]
    for k in old:
        await store.put("t", k, block(k))
    await asyncio.sleep(1.2)
    assert await store.expire("t") == len(old)
    await store.set_limits("t", ttl_s=0)  # no TTL any more: only a record keeps them gone
    new = [f"new{i}" for i in range(3)]
    for k in new:
        await store.put("t", k, block(k))
    await store.close()
    shutil.rmtree(config.data_dir / "index")
    store = await open_store()
    assert await present(store, "t", old + new) == set(new)


async def test_a_removal_writes_one_tombstone_per_block(open_store: OpenStore) -> None:
    """What durable removal costs: one 4 KiB tombstone record per block removed."""
    store = await open_store()
    await store.create_tenant("q", "direct", quota_bytes=1024 * KiB)
    for i in range(32):
        await store.put("q", f"k{i}", block(f"k{i}"))
    evicted = int(store.metrics.counter("kvstore_quota_evictions_total"))
    written = int(store.metrics.counter("kvstore_bytes_written_total"))
    assert evicted > 0
    records = 32 * (64 * KiB + 4 * KiB)  # a direct record: a 4 KiB header page and the payload
    assert written == records + evicted * 4 * KiB

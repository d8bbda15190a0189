"""Regression tests of issue 10 (trust under concurrency), each named after its defect."""

from __future__ import annotations

import asyncio
import hashlib
import random
import shutil

from kvstore.store import Store
from tests.conftest import OpenStore


def _block(tenant: str, key: str) -> bytes:
    rnd = random.Random(f"{tenant}/{key}")
    size = rnd.randint(1_000, 300_000)
    seed = hashlib.sha256(f"{tenant}/{key}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


async def _read_all(store: Store, acked: dict[tuple[str, str], bytes]) -> tuple[int, int]:
    wrong = missing = 0
    for (tenant, key), data in acked.items():
        if not await store.exists(tenant, key):
            missing += 1
        elif await store.get(tenant, key) != data:
            wrong += 1
    return wrong, missing


async def test_flush_under_write_load_corrupted_segments(open_store: OpenStore) -> None:
    """A flush sealed the open segment on a pool thread while the appender was
    writing a batch to it: acknowledged blocks read back wrong after a restart
    and went missing after an index rebuild. A seal now goes through the
    tenant's appender, in order with its batches."""
    store = await open_store(segment_size="4MiB")
    await store.create_tenant("sealed")
    await store.create_tenant("direct", "direct")
    acked: dict[tuple[str, str], bytes] = {}
    stop = asyncio.Event()

    async def writer(w: int) -> None:
        i = 0
        while not stop.is_set():
            tenant = ("sealed", "direct")[i % 2]
            key = f"w{w}-{i}"
            data = _block(tenant, key)
            await store.put(tenant, key, data)
            acked[(tenant, key)] = data
            i += 1

    async def flusher() -> int:
        n = 0
        while not stop.is_set():
            await store.flush()
            n += 1
            await asyncio.sleep(0)
        return n

    tasks = [asyncio.create_task(writer(w)) for w in range(6)]
    flushes = asyncio.create_task(flusher())
    await asyncio.sleep(4)
    stop.set()
    await asyncio.gather(*tasks)
    assert await flushes > 10 and len(acked) > 100
    report = await store.verify(deep=True)
    assert report.ok, report.errors[:5]
    await store.close()

    store = await open_store()
    assert await _read_all(store, acked) == (0, 0)
    assert (await store.verify(deep=True)).ok
    await store.close()
    shutil.rmtree(store.config.data_dir / "index")
    store = await open_store()
    assert store.recovery.index_rebuilt
    assert await _read_all(store, acked) == (0, 0)

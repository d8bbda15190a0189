"""Write plans on a real store, racing what else changes a tenant's
segments: puts and deletes of the same keys, flushes, compaction, tenant
deletion. Every acknowledged block reads back as written, through restarts
and an index rebuild; nothing uncommitted or deleted is ever served."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvstore.config import StoreConfig
from kvstore.engine import directio
from kvstore.engine.store import Store
from kvstore.engine.store_write_plans import WritePlan
from kvstore.engine.types import Stored
from kvstore.errors import KVStoreError, NotPlannable, TenantNotFound, WritePlanNotFound
from tests.conftest import OpenStore
from tests.fault.smallfs import MiB, mount_tmpfs, unmount


def block(key: str, n: int = 60_000) -> bytes:
    return random.Random(key).randbytes(n)


def write(plan: WritePlan, blocks: dict[str, bytes]) -> dict[str, list[int]]:
    """Write the planned blocks as a client would; their frame checksums."""
    sums: dict[str, list[int]] = {}
    for key, w in plan.writes.items():
        data = blocks[key]
        fd = os.open(w.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data + bytes(w.length - len(data)), w.offset)
        finally:
            os.close(fd)
        fs = w.frame_size
        sums[key] = [xxhash.xxh3_64_intdigest(data[i : i + fs]) for i in range(0, len(data), fs)]
    return sums


async def plan_and_commit(store: Store, tenant: str, blocks: dict[str, bytes]) -> dict[str, Stored | KVStoreError]:
    plan = await store.plan_writes(tenant, [(k, len(v)) for k, v in blocks.items()], 30)
    sums = write(plan, blocks)
    await asyncio.sleep(0)  # let others in between the writes and the commit
    return dict(await store.commit_writes(tenant, plan.id, sums)) if sums else {}


async def contents(store: Store, tenant: str, keys: list[str]) -> dict[str, bytes | None]:
    return {k: (bytes(await store.get(tenant, k)) if await store.exists(tenant, k) else None) for k in keys}


async def test_planned_blocks_race_puts_deletes_flushes_and_compaction(open_store: OpenStore) -> None:
    store = await open_store(segment_size=1 << 20, compact_dead_percent=10)
    await store.create_tenant("d", "direct")
    written: dict[str, list[bytes]] = {}
    planned_created: list[str] = []
    keys = [f"k{i}" for i in range(60)]
    for k in keys:
        written[k] = []
    rnd = random.Random(7)
    stop = asyncio.Event()

    async def planner() -> None:
        for r in range(30):
            chosen = rnd.sample(keys, 4)
            blocks = {k: block(f"{k}-{r}") for k in chosen}
            for k, v in blocks.items():
                written[k].append(v)
            done = await plan_and_commit(store, "d", blocks)
            for res in done.values():
                assert isinstance(res, Stored), res
                if res.created:
                    planned_created.append(res.info.key)

    async def churn() -> None:
        i = 0
        while not stop.is_set():
            k = rnd.choice(keys)
            if rnd.random() < 0.5:
                await store.delete("d", k)
            else:
                data = block(f"{k}-put-{i}")
                written[k].append(data)
                await store.put("d", k, data)
            i += 1
            if i % 10 == 0:
                await store.flush()
            if i % 15 == 0:
                report = await store.compact()
                assert not report.errors, report.errors
            await asyncio.sleep(0)

    task = asyncio.create_task(churn())
    try:
        await planner()
    finally:
        stop.set()
        await task
    # The churn's answers and the planner's interleave per key in the order
    # the store serialized them: what the store answers now is the truth to keep.
    now = await contents(store, "d", keys)
    for k, v in now.items():
        assert v is None or v in written[k], f"{k} answers bytes never written to it"
    assert any(v is not None for v in now.values()) and planned_created
    await store.flush()
    assert not (await store.compact()).errors
    assert (await store.verify(deep=True)).ok
    await store.close()
    store = await open_store(segment_size=1 << 20)
    assert await contents(store, "d", keys) == now
    await store.close()
    shutil.rmtree(store.config.data_dir / "index")
    store = await open_store(segment_size=1 << 20)
    assert store.recovery.index_rebuilt
    assert await contents(store, "d", keys) == now, "an index rebuild answers differently after write plans"
    await store.close()


async def test_a_reserved_key_keeps_its_tombstone_through_compaction(open_store: OpenStore) -> None:
    """A key deleted (its tombstone in a newer segment than its block) and
    then reserved: compaction of the tombstone's segment waits for the plan
    (a copy of the tombstone past the planned record would delete the
    committed block at an index rebuild); committed, the block survives a
    rebuild; abandoned, the key stays deleted."""
    store = await open_store(segment_size=1 << 20, compact_dead_percent=50)
    await store.create_tenant("d", "direct")
    for key, n in (("a", 60_000), ("b", 60_000), ("f1", 280_000), ("f2", 280_000), ("f3", 280_000)):
        await store.put("d", key, block(key, n))  # one segment, mostly live once a and b go: not compacted
    await store.flush()
    for key in ("a", "b"):
        await store.delete("d", key)  # tombstones in the next segment, which needs them
    await store.put("d", "x", block("x", 400_000))
    await store.delete("d", "x")  # that segment is mostly dead: compaction wants it
    await store.flush()
    plans = {key: await store.plan_writes("d", [(key, 50_000)], 30) for key in ("a", "b")}
    report = await store.compact()
    assert not report.errors and report.deferred >= 1, report
    sums = write(plans["a"], {"a": block("a2", 50_000)})
    done = await store.commit_writes("d", plans["a"].id, sums)
    assert isinstance(done["a"], Stored) and done["a"].created
    await store.abandon_writes("d", plans["b"].id)
    await store.flush()
    for compacted in (False, True):
        if compacted:
            report = await store.compact()
            assert not report.errors and report.deferred == 0 and report.segments_rewritten >= 1, report
        await store.close()
        shutil.rmtree(store.config.data_dir / "index")
        store = await open_store(segment_size=1 << 20, compact_dead_percent=50)
        assert store.recovery.index_rebuilt
        assert bytes(await store.get("d", "a")) == block("a2", 50_000), f"compacted again: {compacted}"
        assert not await store.exists("d", "b")
        assert not await store.exists("d", "x")
    await store.close()


async def test_tenant_deleted_while_its_plan_is_open(open_store: OpenStore) -> None:
    store = await open_store()
    await store.create_tenant("d", "direct")
    plan = await store.plan_writes("d", [("a", 10_000)], 30)
    sums = write(plan, {"a": block("a", 10_000)})
    await store.delete_tenant("d")
    with pytest.raises((TenantNotFound, WritePlanNotFound, KVStoreError)):
        await store.commit_writes("d", plan.id, sums)
    await store.create_tenant("d", "direct")
    assert not await store.exists("d", "a")
    await store.close()


async def test_only_direct_tenants_plan_writes(store: Store) -> None:
    await store.create_tenant("s", "sealed")
    with pytest.raises(NotPlannable):
        await store.plan_writes("s", [("a", 10)], 30)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "fs"
    mount_tmpfs(where, 64 * MiB)
    yield where
    unmount(where)


async def test_write_plans_on_a_filesystem_without_o_direct(
    tmpfs: Path, open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tmpfs: the plan says to write through the page cache (the daemon
    writes those segments so), and the commit reads back the same way."""
    monkeypatch.setattr(directio, "_probed", {})
    store = await open_store(StoreConfig.from_env(tmpfs / "data", env={}, segment_size="16MiB"))
    await store.create_tenant("d", "direct")
    blocks = {f"k{i}": block(f"t{i}", 70_000 + i) for i in range(4)}
    plan = await store.plan_writes("d", [(k, len(v)) for k, v in blocks.items()], 30)
    assert all(not w.reservation.direct for w in plan.writes.values())
    done = await store.commit_writes("d", plan.id, write(plan, blocks))
    assert all(isinstance(r, Stored) and r.created for r in done.values())
    assert await contents(store, "d", list(blocks)) == blocks
    await store.close()


async def test_a_commit_that_fails_midway_leaves_only_a_pad(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index commit fails after the header went over the pad (EIO
    injected): the pad is put back, so the block is served neither now, nor
    after a restart, nor after an index rebuild; the key can be written again."""
    store = await open_store()
    await store.create_tenant("d", "direct")
    data = block("a", 90_000)
    plan = await store.plan_writes("d", [("a", len(data))], 30)
    sums = write(plan, {"a": data})
    life = store._life
    indexed = life.appended

    def fail_with_entries(tenant: str, sid: int, ops: object, *rest: object, **kw: object) -> None:
        if ops:
            raise OSError(errno.EIO, "injected: the index commit failed")
        indexed(tenant, sid, ops, *rest, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(life, "appended", fail_with_entries)
    with pytest.raises(KVStoreError):
        await store.commit_writes("d", plan.id, sums)
    monkeypatch.undo()
    assert not await store.exists("d", "a")
    await store.close()
    store = await open_store()
    assert not await store.exists("d", "a")
    assert (await store.verify(deep=True)).ok
    await store.close()
    shutil.rmtree(store.config.data_dir / "index")
    store = await open_store()
    assert store.recovery.index_rebuilt and not await store.exists("d", "a")
    done = await plan_and_commit(store, "d", {"a": data})
    assert isinstance(done["a"], Stored) and done["a"].created
    assert bytes(await store.get("d", "a")) == data
    await store.close()

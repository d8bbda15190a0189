"""Compaction killed at every step, then recovery: nothing acknowledged is
lost, nothing deleted comes back, no duplicate is visible, and an index
rebuild answers the same (compact_killer.py dies at the chosen step)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.engine.crypto import MasterKey
from kvstore.engine.store import Store
from tests.fault.compact_killer import KILL_POINTS, MASTER_ENV, config

KILLER = Path(__file__).with_name("compact_killer.py")
TENANTS = (("alice", "sealed"), ("direct", "direct"))
KEYS = [f"k{i:03d}" for i in range(90)]


def content(tenant: str, key: str) -> bytes:
    rnd = random.Random(f"{tenant}/{key}")
    seed = hashlib.sha256(f"{tenant}/{key}".encode()).digest()
    n = rnd.randint(3_000, 120_000)
    return (seed * (n // 32 + 1))[:n]


async def prepare(data_dir: Path, tier_dir: Path, master: MasterKey) -> dict[tuple[str, str], bytes | None]:
    """Blocks written, most deleted, some rewritten, the segments mirrored:
    what every later answer must be."""
    store = await Store.open(config(str(data_dir), str(tier_dir)), master)
    expected: dict[tuple[str, str], bytes | None] = {}
    try:
        for tenant, policy in TENANTS:
            await store.create_tenant(tenant, policy)
            for k in KEYS:
                await store.put(tenant, k, content(tenant, k))
                expected[(tenant, k)] = content(tenant, k)
            await store.flush(upload_timeout_s=60)  # the first segments are mirrored
            for k in KEYS[::4] + KEYS[1::4] + KEYS[2::4]:
                await store.delete(tenant, k)
                expected[(tenant, k)] = None
            for k in KEYS[1:12:4]:  # deleted, then written again with other bytes
                await store.put(tenant, k, b"again " + k.encode() * 500)
                expected[(tenant, k)] = b"again " + k.encode() * 500
            await store.flush(upload_timeout_s=60)
            # A segment that stays mostly live (never compacted), a few of its
            # blocks deleted by tombstones that land among dead records: those
            # tombstones must outlive the compaction of their own segment.
            kept = [f"kept{i:03d}" for i in range(12)]
            for k in kept:
                await store.put(tenant, k, content(tenant, k))
                expected[(tenant, k)] = content(tenant, k)
            await store.flush(upload_timeout_s=60)
            junk = [f"junk{i:03d}" for i in range(30)]
            for k in junk:
                await store.put(tenant, k, content(tenant, k))
            for k in [*junk, *kept[:3]]:
                await store.delete(tenant, k)
                expected[(tenant, k)] = None
            await store.flush(upload_timeout_s=60)
    finally:
        await store.close()
    return expected


async def check(store: Store, expected: dict[tuple[str, str], bytes | None], when: str) -> None:
    for (tenant, key), want in expected.items():
        have = bytes(await store.get(tenant, key)) if await store.exists(tenant, key) else None
        assert have == want, f"{when}: {tenant}/{key}: {'missing' if have is None else 'wrong bytes'}"
    for tenant, _ in TENANTS:
        live = [k for (t, k), v in expected.items() if t == tenant and v is not None]
        stats = await store.stats(tenant)
        assert stats.blocks == len(live), f"{when}: {tenant} counts {stats.blocks} blocks, expected {len(live)}"
        assert [k async for k in store.iter_keys(tenant)] == sorted(live), f"{when}: {tenant} lists other keys"


@pytest.mark.parametrize(
    ("point", "nth"),
    [(p, n) for p in KILL_POINTS for n in ((1, 7) if p in ("copy", "before-copy") else (1,))],
)
async def test_compaction_killed_at_every_step(tmp_path: Path, point: str, nth: int) -> None:
    master = MasterKey(os.urandom(32))
    data_dir, tier_dir = tmp_path / "data", tmp_path / "tier"
    expected = await prepare(data_dir, tier_dir, master)
    env = {**os.environ, MASTER_ENV: master.secret.hex()}
    out = subprocess.run(
        [sys.executable, str(KILLER), str(data_dir), str(tier_dir), point, str(nth)],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == -9, f"the child did not die at {point}:{nth} (rc {out.returncode}): {out.stderr[-2000:]!r}"

    store = await Store.open(config(str(data_dir), str(tier_dir)), master)
    try:
        assert not store.recovery.corrupt, store.recovery.corrupt
        await check(store, expected, f"after a kill at {point}:{nth}")
    finally:
        await store.close()
    shutil.rmtree(data_dir / "index")  # mid-compaction: old and new copies may both be there
    store = await Store.open(config(str(data_dir), str(tier_dir)), master)
    try:
        assert store.recovery.index_rebuilt and not store.recovery.corrupt, store.recovery.as_dict()
        await check(store, expected, f"after a kill at {point}:{nth} and an index rebuild")
        report = await store.compact()  # the interrupted work is finished
        assert not report.errors, report.errors
        await store.flush(upload_timeout_s=60)
        await store.compact()  # the old objects go once the copies are mirrored
        await check(store, expected, "after the next pass")
        assert (await store.verify(deep=True)).ok
    finally:
        await store.close()
    shutil.rmtree(data_dir / "index")
    store = await Store.open(config(str(data_dir), str(tier_dir)), master)
    try:
        assert store.recovery.index_rebuilt
        await check(store, expected, "after an index rebuild")
    finally:
        await store.close()
    # A node rebuilt from the object tier alone answers the same.
    shutil.rmtree(data_dir)
    store = await Store.open(config(str(data_dir), str(tier_dir)), master)
    try:
        await check(store, expected, "on a node rebuilt from the object tier")
    finally:
        await store.close()

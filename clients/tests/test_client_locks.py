"""lookup_and_lock / release_locks against real daemons: one lease per daemon
that found keys, locked blocks kept under quota pressure, releases that
report what is left to retry."""

from __future__ import annotations

import os

import pytest
from conftest import DaemonFactory
from kvstore_client import AsyncClient, Locks

KiB = 1 << 10


async def test_locked_blocks_survive_quota_pressure(make_daemon: DaemonFactory) -> None:
    d = make_daemon()
    d.admin("PATCH", "/v1/admin/tenants/acme", {"quota_bytes": 512 * KiB})
    values = {f"lock-{i}": os.urandom(64 * KiB) for i in range(3)}
    async with AsyncClient(d.url, d.token, timeout=5) as c:
        assert await c.put_many(values.items()) == [True] * 3
        present, locks = await c.lookup_and_lock([*values, "absent"], lease_s=30)
        assert present == [True, True, True, False]
        assert len(locks.leases) == 1 and locks.leases[0][0] == d.url
        for i in range(24):  # 1.5 MiB of newer blocks: three times the quota
            assert await c.put(f"new-{i}", os.urandom(64 * KiB))
        assert await c.get_many(list(values)) == list(values.values())
        assert not await c.exists("new-0")  # evicted in their place

        assert await c.release_locks(locks) == Locks()
        assert await c.release_locks(locks) == Locks()  # released already: nothing left to do
        for i in range(24, 48):
            assert await c.put(f"new-{i}", os.urandom(64 * KiB))
        assert await c.lookup_detail(list(values)) == [False] * 3

        none_present, no_locks = await c.lookup_and_lock(["absent"])
        assert none_present == [False] and not no_locks


async def test_one_lease_per_daemon_and_a_dead_one(make_daemon: DaemonFactory) -> None:
    ds = [make_daemon() for _ in range(3)]
    tokens = {d.url: d.token for d in ds}
    keys = [f"k{i}" for i in range(60)]
    async with AsyncClient(list(tokens), tokens, timeout=1, retries=0) as c:
        assert await c.put_many([(k, k.encode()) for k in keys]) == [True] * 60
        present, locks = await c.lookup_and_lock(keys)
        assert present == [True] * 60
        assert sorted(url for url, _ in locks.leases) == sorted(tokens)

        dead = ds[2]
        dead.stop()
        assert await c.release_locks(locks) == Locks(tuple(lease for lease in locks.leases if lease[0] == dead.url))
        present, locks = await c.lookup_and_lock(keys)
        assert present == [c.owners(k) != [dead.url] for k in keys]
        assert sorted(url for url, _ in locks.leases) == sorted(d.url for d in ds[:2])
        assert await c.release_locks(locks) == Locks()


async def test_put_many_detail_tells_stored_from_there_already(make_daemon: DaemonFactory) -> None:
    d = make_daemon()
    async with AsyncClient(d.url, d.token, timeout=2, retries=0) as c:
        assert await c.put_many_detail([("a", b"1"), ("b", b"2")]) == [201, 201]
        assert await c.put_many_detail([("a", b"1"), ("c", b"3")]) == [200, 201]
        d.stop()
        assert await c.put_many_detail([("d", b"4")]) == [None]


async def test_lease_bounds_are_checked(make_daemon: DaemonFactory) -> None:
    d = make_daemon()
    async with AsyncClient(d.url, d.token) as c:
        for bad in (0, -1, 601, True):
            with pytest.raises(ValueError, match="lease_s"):
                await c.lookup_and_lock(["k"], lease_s=bad)

"""Rendezvous sharding over three real daemons; replicas."""

from __future__ import annotations

from conftest import Daemon, DaemonFactory
from kvstore_client import AsyncClient, Client


def _three(make_daemon: DaemonFactory) -> tuple[list[Daemon], dict[str, str]]:
    ds = [make_daemon() for _ in range(3)]
    return ds, {d.url: d.token for d in ds}


async def test_spread_and_one_dead_shard(make_daemon: DaemonFactory) -> None:
    ds, tokens = _three(make_daemon)
    keys = [f"key-{i}" for i in range(300)]
    async with AsyncClient(list(tokens), tokens, timeout=1, retries=0) as c:
        assert await c.put_many([(k, k.encode()) for k in keys]) == [True] * 300
        counts = [d.blocks() for d in ds]
        assert sum(counts) == 300
        assert all(60 <= n <= 140 for n in counts), counts  # about 100 each
        for d, n in zip(ds, counts, strict=True):
            assert n == sum(c.owners(k) == [d.url] for k in keys)
        assert await c.lookup(keys) == 300  # split by owner, combined

        dead = ds[1]
        dead.stop()
        got = await c.get_many(keys)
        for k, v in zip(keys, got, strict=True):
            assert v == (None if c.owners(k) == [dead.url] else k.encode())
        for k in keys[:20]:
            assert await c.get(k) == (None if c.owners(k) == [dead.url] else k.encode())
        present = await c.lookup_detail(keys)
        assert present == [c.owners(k) != [dead.url] for k in keys]
        assert c.breaker_state(dead.url) == "open"
        assert c.breaker_state(ds[0].url) == "closed"


def test_replicas_survive_one_dead_shard(make_daemon: DaemonFactory) -> None:
    ds, tokens = _three(make_daemon)
    keys = [f"r{i}" for i in range(60)]
    with Client(list(tokens), tokens, timeout=1, retries=0, replicas=2) as c:
        assert c.put_many([(k, k.encode()) for k in keys[:30]]) == [True] * 30
        for k in keys[30:]:
            assert c.put(k, k.encode())
        assert sum(d.blocks() for d in ds) == 120  # two copies each
        ds[0].stop()
        assert c.get_many(keys) == [k.encode() for k in keys]
        assert all(c.get(k) == k.encode() for k in keys[:10])
        assert c.lookup(keys) == 60
        assert all(c.exists(k) for k in keys[:10])

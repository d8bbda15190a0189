"""NIXL reads and writes while the daemon's maintenance runs: segments fill
and seal under the writers, blocks are deleted, and compaction rewrites
segments (moving the blocks that direct reads point into) over and over.
Every read must give the block's bytes or, for a block deleted meanwhile,
a miss, and none may leave NIXL for HTTP; every acknowledged write must
read back afterwards. Bounded: a few
seconds of load, two tenants (direct and sealed), two workers."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
from kvstore_client import AsyncClient
from kvstore_client.nixl import nixl_available

from .conftest import Daemon
from .test_nixl import _auth, _no_leases, _start
from .test_read_plans import _admin, _tenant

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install --no-deps nixl-cu12 nixl; tests/run.sh does)"
)
LOAD_S = 6.0
BATCH = 4


class Book:
    """What the writers were told was stored, and what was deleted since."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}  # every acknowledged write, deleted or not
        self.live: list[str] = []
        self.deleted: set[str] = set()
        self.reads = 0
        self.misses_of_deleted = 0


async def _writer(c: AsyncClient, book: Book, prefix: str, stop: float) -> None:
    rng = random.Random(prefix)
    n = 0
    while time.monotonic() < stop:
        items = [(f"{prefix}{n + i}", rng.randbytes(rng.randrange(30_000, 250_000))) for i in range(BATCH)]
        n += BATCH
        for (k, v), ok in zip(items, await c.put_many(items), strict=True):
            assert ok, k
            book.values[k] = v
            book.live.append(k)


async def _deleter(s: aiohttp.ClientSession, base: str, token: str, book: Book, stop: float) -> None:
    rng = random.Random(token)
    while time.monotonic() < stop:
        await asyncio.sleep(0.02)
        if len(book.live) < 20:
            continue
        k = book.live.pop(rng.randrange(len(book.live) - 10))  # not the newest: let readers find them first
        book.deleted.add(k)  # before the DELETE: a read that misses it from now on is right
        async with s.delete(f"{base}/v1/blocks/{k}", headers=_auth(token)) as r:
            assert r.status == 204, await r.text()


async def _reader(c: AsyncClient, book: Book, seed: int, stop: float) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop:
        known = list(book.values)
        if not known:
            await asyncio.sleep(0.01)
            continue
        keys = rng.sample(known, min(8, len(known)))
        bufs = [bytearray(len(book.values[k])) for k in keys]
        got = await c.get_many_into(keys, bufs)
        for k, n, buf in zip(keys, got, bufs, strict=True):
            if n is None:
                assert k in book.deleted, f"{k}: acknowledged, never deleted, and missing"
                book.misses_of_deleted += 1
            else:
                assert n == len(book.values[k]) and buf == book.values[k], f"{k}: wrong bytes"
        book.reads += len(keys)


async def _compactor(s: aiohttp.ClientSession, base: str, stop: float) -> int:
    rewritten = 0
    while time.monotonic() < stop:
        report = await _admin(s, base, "POST", "/v1/admin/compact")
        assert isinstance(report, dict) and not report.get("errors"), report
        rewritten += int(report["segments_rewritten"])
        await asyncio.sleep(0.05)
    return rewritten


async def test_reads_and_writes_over_nixl_while_blocks_move(daemon: Daemon) -> None:
    _start(daemon, workers=2, compact_dead_percent="20")
    base = daemon.base
    async with aiohttp.ClientSession() as s:
        tokens = {policy: await _tenant(s, base, f"stress-{policy}", policy) for policy in ("direct", "sealed")}
        books = {policy: Book() for policy in tokens}
        stop = time.monotonic() + LOAD_S
        clients = {
            policy: AsyncClient(base, token, transport="nixl", strict=True, timeout=30)
            for policy, token in tokens.items()
        }
        try:
            jobs = [asyncio.ensure_future(_compactor(s, base, stop))]
            for policy, c in clients.items():
                book, token = books[policy], tokens[policy]
                jobs += [
                    asyncio.ensure_future(_writer(c, book, policy[0], stop)),
                    asyncio.ensure_future(_deleter(s, base, token, book, stop)),
                    asyncio.ensure_future(_reader(c, book, 1, stop)),
                    asyncio.ensure_future(_reader(c, book, 2, stop)),
                ]
            results = await asyncio.gather(*jobs)
            rewritten = results[0]
            for c in clients.values():
                # Nothing here is a reason to leave NIXL: a fallback is a bug (it found two).
                assert c.stats["nixl_reads"] > 0 and c.stats["nixl_writes"] > 0, c.stats
                assert c.stats["nixl_fallbacks"] == 0, c.stats
        finally:
            for c in clients.values():
                await c.close()
        assert rewritten >= 1, "compaction never moved a block: the test did not exercise what it is for"
        # Afterwards: every acknowledged block that was not deleted reads back, over HTTP and NIXL.
        for policy, token in tokens.items():
            book = books[policy]
            assert book.reads > 50 and book.deleted, (policy, book.reads, len(book.deleted))
            for k in book.live:
                async with s.get(f"{base}/v1/blocks/{k}", headers=_auth(token)) as r:
                    assert r.status == 200 and await r.read() == book.values[k], k
            for k in book.deleted:
                async with s.get(f"{base}/v1/blocks/{k}", headers=_auth(token)) as r:
                    assert r.status == 404, k
            async with AsyncClient(base, token, transport="nixl", strict=True, timeout=30) as c:
                bufs = [bytearray(len(book.values[k])) for k in book.live]
                assert await c.get_many_into(book.live, bufs) == [len(book.values[k]) for k in book.live]
                assert all(b == book.values[k] for k, b in zip(book.live, bufs, strict=True))
        assert (await _no_leases(s, base, 5))["leases"] == 0

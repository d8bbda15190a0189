"""Locks: ``POST /v1/lookup`` with ``lease_s`` pins the blocks it finds (the
tenant's quota never evicts them, its TTL never expires them, compaction
leaves their segments) until ``DELETE /v1/leases/{lease}`` or expiry.

Raw HTTP on real servers: in-process (``api``) where one process will do,
``server.py`` (``daemon``) for the unix socket listener and for workers."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.http.conftest import ADMIN, Api, Daemon
from tests.http.rawhttp import worker_connections

KiB = 1 << 10
BLOCK = 64 * KiB
QUOTA = 16 * BLOCK  # 1 MiB


def _data(key: str) -> bytes:
    """A block's bytes, known from its key alone (checked byte for byte);
    random, so compression leaves them their size against the quota."""
    return random.Random(key).randbytes(BLOCK)


async def _put(s: aiohttp.ClientSession, base: str, h: dict[str, str], key: str) -> int:
    async with s.put(f"{base}/v1/blocks/{key}", data=_data(key), headers=h) as r:
        await r.read()
        return r.status


async def _lock(
    s: aiohttp.ClientSession, base: str, h: dict[str, str], keys: list[str], lease_s: float = 30
) -> dict[str, Any]:
    async with s.post(f"{base}/v1/lookup", json={"keys": keys, "lease_s": lease_s}, headers=h) as r:
        assert r.status == 200, await r.text()
        doc: dict[str, Any] = await r.json()
        return doc


async def _get(s: aiohttp.ClientSession, base: str, h: dict[str, str], key: str) -> bytes | None:
    async with s.get(f"{base}/v1/blocks/{key}", headers=h) as r:
        assert r.status in (200, 404), await r.text()
        return await r.read() if r.status == 200 else None


async def _release(s: aiohttp.ClientSession, base: str, h: dict[str, str], lease: str) -> int:
    async with s.delete(f"{base}/v1/leases/{lease}", headers=h) as r:
        if r.status == 404:
            assert (await r.json())["error"]["code"] == "lease_not_found"
        return r.status


async def _tenant(s: aiohttp.ClientSession, base: str, name: str, **limits: int) -> dict[str, str]:
    """A tenant (sealed), with ``limits`` (quota_bytes, ttl_s); its auth header."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with s.post(f"{base}/v1/admin/tenants", json={"name": name}, headers=admin) as r:
        assert r.status == 201, await r.text()
        h = {"Authorization": f"Bearer {(await r.json())['token']}"}
    if limits:
        async with s.patch(f"{base}/v1/admin/tenants/{name}", json=limits, headers=admin) as r:
            assert r.status == 200, await r.text()
    return h


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


# -- one process -------------------------------------------------------------------


async def test_lookup_with_lease_answers_and_validates(api: Api) -> None:
    s, base = api.session, api.base
    h = await _tenant(s, base, "a")
    assert await _put(s, base, h, "k1") == 201
    doc = await _lock(s, base, h, ["k1", "nope"])
    assert doc["present"] == [True, False] and doc["prefix"] == 1
    assert isinstance(doc["lease"], str) and doc["expires_in_s"] == 30
    assert set(doc) == {"prefix", "present", "lease", "expires_in_s"}
    none = await _lock(s, base, h, ["nope", "k1"])
    assert none["present"] == [False, True] and none["prefix"] == 0 and isinstance(none["lease"], str)
    absent = await _lock(s, base, h, ["nope"])
    assert absent["lease"] is None and absent["present"] == [False] and absent["expires_in_s"] == 30
    async with s.post(api.url("/v1/lookup"), json={"keys": ["k1"]}, headers=h) as r:
        assert await r.json() == {"prefix": 1, "present": [True]}  # without lease_s: as ever
    for bad in (0, -1, 601, "x", True, None, [5]):
        async with s.post(api.url("/v1/lookup"), json={"keys": ["k1"], "lease_s": bad}, headers=h) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "invalid_input" and "lease_s" in err["message"], (bad, err)
    assert (await _lock(s, base, h, ["k1"], lease_s=600))["lease"] is not None  # the bound is allowed

    other = await _tenant(s, base, "b")
    assert await _release(s, base, other, doc["lease"]) == 404  # another tenant's
    assert await _release(s, base, h, doc["lease"]) == 204
    assert await _release(s, base, h, doc["lease"]) == 404  # released already
    assert await _release(s, base, h, "0" * 32) == 404  # never given
    async with s.delete(api.url(f"/v1/leases/{none['lease']}")) as r:
        assert r.status == 401


async def test_locked_blocks_survive_quota_pressure(api: Api) -> None:
    s, base = api.session, api.base
    h = await _tenant(s, base, "q", quota_bytes=QUOTA)
    locked = [f"lock-{i}" for i in range(4)]
    for k in [*locked, "old-0", "old-1"]:
        assert await _put(s, base, h, k) == 201
    lease = (await _lock(s, base, h, locked))["lease"]
    for i in range(48):  # three times the quota
        assert await _put(s, base, h, f"new-{i}") == 201
    for k in locked:
        assert await _get(s, base, h, k) == _data(k)
    assert await _get(s, base, h, "old-0") is None and await _get(s, base, h, "old-1") is None
    assert await _get(s, base, h, "new-0") is None  # the oldest unlocked went instead

    # Locks holding the whole quota: a put that cannot be given room is refused.
    fill_leases, refused = [], None
    for i in range(48, 80):
        async with s.put(api.url(f"/v1/blocks/new-{i}"), data=_data(f"new-{i}"), headers=h) as r:
            if r.status == 507:
                refused = (await r.json())["error"]
                break
            assert r.status == 201, await r.text()
        fill_leases.append((await _lock(s, base, h, [f"new-{i}"]))["lease"])
    assert refused is not None and refused["code"] == "quota_exceeded" and "leases" in refused["message"]
    for k in locked:
        assert await _get(s, base, h, k) == _data(k)
    for fill_lease in fill_leases:
        assert await _release(s, base, h, fill_lease) == 204
    assert await _release(s, base, h, lease) == 204
    assert await _release(s, base, h, lease) == 404
    for i in range(80, 128):
        assert await _put(s, base, h, f"new-{i}") == 201
    assert [await _get(s, base, h, k) for k in locked] == [None] * 4  # evicted once unlocked


async def test_a_lock_ends_by_itself(api: Api) -> None:
    s, base = api.session, api.base
    h = await _tenant(s, base, "e", quota_bytes=QUOTA)
    locked = [f"lock-{i}" for i in range(4)]
    for k in locked:
        assert await _put(s, base, h, k) == 201
    lease = (await _lock(s, base, h, locked, lease_s=1))["lease"]
    assert (await _lock(s, base, h, locked, lease_s=0.5))["lease"] != lease  # each lock is its own lease
    await asyncio.sleep(1.2)
    for i in range(32):  # twice the quota: nothing holds the old blocks now
        assert await _put(s, base, h, f"new-{i}") == 201
    assert [await _get(s, base, h, k) for k in locked] == [None] * 4
    assert await _release(s, base, h, lease) == 404  # expired


async def test_a_lock_outlives_the_ttl_and_its_release_ends_that(api: Api) -> None:
    s, base = api.session, api.base
    h = await _tenant(s, base, "t", ttl_s=1)
    for k in ("kept", "released", "free"):
        assert await _put(s, base, h, k) == 201
    kept = (await _lock(s, base, h, ["kept"], lease_s=3))["lease"]
    released = (await _lock(s, base, h, ["released"], lease_s=30))["lease"]
    assert await _release(s, base, h, released) == 204
    await asyncio.sleep(1.6)  # past the TTL: the unlocked blocks are misses, the locked one is not
    assert await _get(s, base, h, "free") is None
    assert await _get(s, base, h, "released") is None
    assert (await _lock(s, base, h, ["kept", "free"], lease_s=1))["present"] == [True, False]
    assert await _get(s, base, h, "kept") == _data("kept")
    await asyncio.sleep(3.2)  # the lease expired on its own, and the last touch is older than the TTL
    assert await _get(s, base, h, "kept") is None
    assert await _release(s, base, h, kept) == 404


async def test_compaction_leaves_locked_segments(api: Api) -> None:
    s, base = api.session, api.base
    h = api.auth(await api.tenant("c", policy="direct"))
    admin = api.auth(ADMIN)
    for i in range(12):  # 768 KiB: one 1 MiB segment, sealed by a flush
        assert await _put(s, base, h, f"b{i}") == 201
    async with s.post(api.url("/v1/admin/flush"), headers=admin) as r:
        assert r.status == 200
    lease = (await _lock(s, base, h, ["b0"]))["lease"]
    for i in range(1, 12):
        async with s.delete(api.url(f"/v1/blocks/b{i}"), headers=h) as r:
            assert r.status == 204
    async with s.post(api.url("/v1/admin/compact?tenant=c"), headers=admin) as r:
        assert (await r.json())["segments_rewritten"] == 0  # the locked block's segment stays
    assert await _get(s, base, h, "b0") == _data("b0")
    assert await _release(s, base, h, lease) == 204
    async with s.post(api.url("/v1/admin/compact?tenant=c"), headers=admin) as r:
        assert (await r.json())["segments_rewritten"] == 1
    assert await _get(s, base, h, "b0") == _data("b0")


async def test_writes_locks_and_releases_together(api: Api) -> None:
    """A few seconds of puts, locks and releases with a small quota: no error
    but 507 quota_exceeded, and every block a lock found reads back whole
    until it is released (a lock never says present for a block that then goes)."""
    h = await _tenant(api.session, api.base, "x", quota_bytes=QUOTA)
    report = await _load(api.session, api.session, api.base, h, seconds=3)
    assert report["locked_reads"] > 50 and report["stored"] > 50, report


# -- server.py: the unix socket listener, and workers ------------------------------


async def test_a_lease_is_released_on_either_listener(daemon: Daemon, sock_dir: Path, session: Any) -> None:
    sock = str(sock_dir / "kv.sock")
    daemon.extra = ["--listen", f"unix:{sock}", "--unix-socket-mode", "0600"]
    daemon.start()
    tcp, base = session, daemon.base
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as unix:
        local = "http://localhost"
        h = await _tenant(unix, local, "u")
        other = await _tenant(tcp, base, "v")
        assert await _put(unix, local, h, "k") == 201
        by_tcp = (await _lock(tcp, base, h, ["k"]))["lease"]
        by_unix = (await _lock(unix, local, h, ["k", "z"]))["lease"]
        assert await _release(unix, local, other, by_tcp) == 404  # another tenant's, on either listener
        assert await _release(tcp, base, other, by_unix) == 404
        assert await _release(unix, local, h, by_tcp) == 204  # locked over TCP, released over the socket
        assert await _release(tcp, base, h, by_unix) == 204  # and the other way round
        assert await _release(unix, local, h, by_unix) == 404
        assert await _release(tcp, base, h, by_tcp) == 404


@pytest.mark.slow
async def test_locks_on_a_reader_hold_on_the_writer(daemon: Daemon, session: Any) -> None:
    """The writer evicts: a lock granted on a reader worker must hold there,
    and a lease is released from any connection, on either worker."""
    daemon.extra = ["--workers", "2"]
    daemon.start()
    base = daemon.base
    h = await _tenant(session, base, "w", quota_bytes=QUOTA)
    conns = await worker_connections("127.0.0.1", daemon.port)
    try:
        locked = [f"lock-{i}" for i in range(4)]
        for k in locked:
            assert await _put(session, base, h, k) == 201
        r = await conns["reader"].request("POST", "/v1/lookup", h, json.dumps({"keys": locked, "lease_s": 60}).encode())
        assert r.status == 200 and r.json()["prefix"] == 4
        lease = r.json()["lease"]
        for i in range(48):  # three times the quota, through the writer
            r = await conns["writer"].request("PUT", f"/v1/blocks/new-{i}", h, _data(f"new-{i}"))
            assert r.status == 201, r.body
        for role, conn in conns.items():
            for k in locked:
                r = await conn.request("GET", f"/v1/blocks/{k}", h)
                assert r.status == 200 and r.body == _data(k), (role, k, r.status)
        assert (await conns["writer"].request("DELETE", f"/v1/leases/{lease}", h)).status == 204
        r = await conns["reader"].request("DELETE", f"/v1/leases/{lease}", h)
        assert (r.status, r.code) == (404, "lease_not_found")
        for i in range(48, 96):
            assert (await conns["writer"].request("PUT", f"/v1/blocks/new-{i}", h, _data(f"new-{i}"))).status == 201
        for k in locked:
            assert (await conns["reader"].request("GET", f"/v1/blocks/{k}", h)).status == 404
        # Locked on the writer, released through a reader (which asks the writer).
        assert await _put(session, base, h, "late") == 201
        r = await conns["writer"].request("POST", "/v1/lookup", h, b'{"keys": ["late"], "lease_s": 60}')
        assert (await conns["reader"].request("DELETE", f"/v1/leases/{r.json()['lease']}", h)).status == 204
    finally:
        for conn in conns.values():
            await conn.close()


@pytest.mark.slow
async def test_writes_locks_and_releases_together_on_two_workers(daemon: Daemon) -> None:
    daemon.extra = ["--workers", "2"]
    daemon.start()
    # Connections closed after each request: they land on either worker.
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as one,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as two,
    ):
        h = await _tenant(one, daemon.base, "x", quota_bytes=QUOTA)
        report = await _load(one, two, daemon.base, h, seconds=4)
    assert report["locked_reads"] > 50 and report["stored"] > 50, report


async def _load(
    one: aiohttp.ClientSession, two: aiohttp.ClientSession, base: str, h: dict[str, str], seconds: float
) -> dict[str, int]:
    """Two writers and two lockers for ``seconds`` (a few hundred requests):
    each lock reads what it found, byte for byte, then releases it from the
    other session. Fails on any answer but 201 / 507 quota_exceeded to a put."""
    deadline = time.monotonic() + seconds
    counts = {"stored": 0, "refused": 0, "locked_reads": 0, "locks": 0}
    written = [0, 0]  # how far each writer got: the lockers ask for its latest blocks

    async def writer(n: int) -> None:
        for i in range(400):
            if time.monotonic() > deadline:
                return
            written[n] = i
            async with one.put(f"{base}/v1/blocks/w{n}-{i}", data=_data(f"w{n}-{i}"), headers=h) as r:
                if r.status == 507:
                    assert (await r.json())["error"]["code"] == "quota_exceeded"
                    counts["refused"] += 1
                else:
                    assert r.status == 201, await r.text()
                    counts["stored"] += 1

    async def locker(n: int) -> None:
        while time.monotonic() < deadline:
            keys = [f"w{w}-{j}" for w in (0, 1) for j in range(max(0, written[w] - 3 - n), written[w] + 1)]
            doc = await _lock(two, base, h, keys, lease_s=20)
            found = [k for k, p in zip(keys, doc["present"], strict=True) if p]
            assert (doc["lease"] is None) == (not found)
            for k in found:
                assert await _get(one, base, h, k) == _data(k), k  # locked: never evicted meanwhile
            counts["locked_reads"] += len(found)
            if doc["lease"] is not None:
                counts["locks"] += 1
                assert await _release(one if n else two, base, h, doc["lease"]) == 204
            await asyncio.sleep(0.01)

    await asyncio.gather(writer(0), writer(1), locker(0), locker(1))
    return counts

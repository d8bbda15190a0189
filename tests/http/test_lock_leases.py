"""Locks: ``POST /v1/lookup`` with ``lease_s`` pins the blocks it finds (the
tenant's quota never evicts them, its TTL never expires them, compaction
leaves their segments) until ``DELETE /v1/leases/{lease}`` or expiry."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import aiohttp
import pytest

from tests.http.conftest import ADMIN, Api, Daemon

KiB = 1 << 10
BLOCK = 64 * KiB


async def _admin(api: Api, method: str, path: str, doc: dict[str, Any]) -> Any:
    async with api.session.request(method, api.url(path), json=doc, headers=api.auth(ADMIN)) as r:
        assert r.status in (200, 201), await r.text()
        return await r.json()


async def _put(s: aiohttp.ClientSession, base: str, h: dict[str, str], key: str, data: bytes) -> int:
    async with s.put(f"{base}/v1/blocks/{key}", data=data, headers=h) as r:
        await r.read()
        return r.status


async def _lock(s: aiohttp.ClientSession, base: str, h: dict[str, str], keys: list[str], **extra: Any) -> Any:
    async with s.post(f"{base}/v1/lookup", json={"keys": keys, "lease_s": 30, **extra}, headers=h) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _get(s: aiohttp.ClientSession, base: str, h: dict[str, str], key: str) -> bytes | None:
    async with s.get(f"{base}/v1/blocks/{key}", headers=h) as r:
        return await r.read() if r.status == 200 else None


async def _release(s: aiohttp.ClientSession, base: str, h: dict[str, str], lease: str) -> int:
    async with s.delete(f"{base}/v1/leases/{lease}", headers=h) as r:
        await r.read()
        return r.status


async def test_lookup_with_lease_answers_and_validates(api: Api) -> None:
    h = api.auth(await api.tenant("a"))
    s = api.session
    assert await _put(s, api.base, h, "k1", b"x" * 100) == 201
    doc = await _lock(s, api.base, h, ["k1", "nope"])
    assert doc["present"] == [True, False] and doc["prefix"] == 1
    assert isinstance(doc["lease"], str) and doc["expires_in_s"] == 30
    none = await _lock(s, api.base, h, ["nope"])
    assert none["lease"] is None and none["present"] == [False]
    async with s.post(api.url("/v1/lookup"), json={"keys": ["k1"]}, headers=h) as r:
        assert set(await r.json()) == {"prefix", "present"}  # without lease_s: as ever
    for bad in (0, -1, 601, "x", True, None):
        async with s.post(api.url("/v1/lookup"), json={"keys": ["k1"], "lease_s": bad}, headers=h) as r:
            body = await r.json()
            assert (
                r.status == 400 and body["error"]["code"] == "invalid_input" and "lease_s" in body["error"]["message"]
            )

    other = api.auth(await api.tenant("b"))
    assert await _release(s, api.base, other, doc["lease"]) == 404  # another tenant's
    assert await _release(s, api.base, h, doc["lease"]) == 204
    async with s.delete(api.url(f"/v1/leases/{doc['lease']}"), headers=h) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "lease_not_found"


async def test_locked_blocks_survive_quota_pressure(api: Api) -> None:
    h = api.auth(await api.tenant("q"))
    await _admin(api, "PATCH", "/v1/admin/tenants/q", {"quota_bytes": 16 * BLOCK})
    s = api.session
    locked = {f"lock-{i}": os.urandom(BLOCK) for i in range(4)}
    for k, v in locked.items():
        assert await _put(s, api.base, h, k, v) == 201
    lease = (await _lock(s, api.base, h, list(locked)))["lease"]
    for i in range(48):  # three times the quota
        assert await _put(s, api.base, h, f"new-{i}", os.urandom(BLOCK)) == 201
    for k, v in locked.items():
        assert await _get(s, api.base, h, k) == v
    assert await _get(s, api.base, h, "new-0") is None  # the oldest unlocked went instead

    # Locks holding the whole quota: a put that cannot be given room is refused.
    fill_leases, refused = [], None
    for i in range(48, 80):
        async with s.put(api.url(f"/v1/blocks/new-{i}"), data=os.urandom(BLOCK), headers=h) as r:
            if r.status == 507:
                refused = (await r.json())["error"]
                break
            assert r.status == 201
        fill_leases.append((await _lock(s, api.base, h, [f"new-{i}"]))["lease"])
    assert refused is not None and refused["code"] == "quota_exceeded" and "leases" in refused["message"]
    for k, v in locked.items():
        assert await _get(s, api.base, h, k) == v
    for fill_lease in fill_leases:
        assert await _release(s, api.base, h, fill_lease) == 204
    assert await _release(s, api.base, h, lease) == 204
    for i in range(80, 128):
        assert await _put(s, api.base, h, f"new-{i}", os.urandom(BLOCK)) == 201
    assert [await _get(s, api.base, h, k) for k in locked] == [None] * 4  # evicted once unlocked


async def test_lease_expiry_and_ttl(api: Api) -> None:
    h = api.auth(await api.tenant("t"))
    await _admin(api, "PATCH", "/v1/admin/tenants/t", {"ttl_s": 1})
    s = api.session
    assert await _put(s, api.base, h, "kept", b"k" * 1000) == 201
    assert await _put(s, api.base, h, "free", b"f" * 1000) == 201
    async with s.post(api.url("/v1/lookup"), json={"keys": ["kept"], "lease_s": 2.5}, headers=h) as r:
        lease = (await r.json())["lease"]
    await asyncio.sleep(1.6)  # past the TTL: the unlocked block is a miss, the locked one is not
    assert await _get(s, api.base, h, "free") is None
    assert await _get(s, api.base, h, "kept") == b"k" * 1000
    await asyncio.sleep(2.5)  # the lease expired on its own (and the read above touched the block a while ago)
    assert await _get(s, api.base, h, "kept") is None
    assert await _release(s, api.base, h, lease) == 404


async def test_compaction_leaves_locked_segments(api: Api) -> None:
    h = api.auth(await api.tenant("c", policy="direct"))
    s = api.session
    for i in range(12):  # 768 KiB: one 1 MiB segment, sealed by a flush
        assert await _put(s, api.base, h, f"b{i}", bytes([i]) * BLOCK) == 201
    async with s.post(api.url("/v1/admin/flush"), headers=api.auth(ADMIN)) as r:
        assert r.status == 200
    lease = (await _lock(s, api.base, h, ["b0"]))["lease"]
    for i in range(1, 12):
        async with s.delete(api.url(f"/v1/blocks/b{i}"), headers=h) as r:
            assert r.status == 204
    compacted = await _admin(api, "POST", "/v1/admin/compact?tenant=c", {})
    assert compacted["segments_rewritten"] == 0  # the locked block's segment stays
    assert await _release(s, api.base, h, lease) == 204
    compacted = await _admin(api, "POST", "/v1/admin/compact?tenant=c", {})
    assert compacted["segments_rewritten"] == 1
    assert await _get(s, api.base, h, "b0") == bytes([0]) * BLOCK


@pytest.mark.slow
async def test_locks_with_two_workers_under_load(daemon: Daemon) -> None:
    """A lock granted on any worker holds on the writer (which evicts); a
    lease is released from any connection; writes, locks and releases run
    together without an error other than quota_exceeded."""
    daemon.extra = ["--workers", "2"]
    daemon.start()
    base = daemon.base
    async with aiohttp.ClientSession() as admin_s:
        async with admin_s.post(
            f"{base}/v1/admin/tenants", json={"name": "w"}, headers={"Authorization": f"Bearer {ADMIN}"}
        ) as r:
            h = {"Authorization": f"Bearer {(await r.json())['token']}"}
        async with admin_s.patch(
            f"{base}/v1/admin/tenants/w", json={"quota_bytes": 24 * BLOCK}, headers={"Authorization": f"Bearer {ADMIN}"}
        ) as r:
            assert r.status == 200
    locked = {f"lock-{i}": os.urandom(BLOCK) for i in range(4)}
    # Separate sessions: requests land on either worker (SO_REUSEPORT spreads connections).
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) for _ in range(4)]
    try:
        for k, v in locked.items():
            assert await _put(sessions[0], base, h, k, v) == 201
        leases = [(await _lock(sessions[i % 4], base, h, list(locked)))["lease"] for i in range(4)]
        statuses: list[int] = []
        deadline = time.monotonic() + 4

        async def writer(n: int) -> None:
            i = 0
            while time.monotonic() < deadline and i < 150:
                statuses.append(await _put(sessions[n], base, h, f"w{n}-{i}", os.urandom(BLOCK)))
                i += 1

        async def locker() -> None:
            while time.monotonic() < deadline:
                keys = [f"w0-{i}" for i in range(0, 150, 7)]
                doc = await _lock(sessions[3], base, h, keys)
                if doc["lease"] is not None:
                    assert await _release(sessions[2], base, h, doc["lease"]) == 204

        await asyncio.gather(writer(0), writer(1), locker())
        assert set(statuses) <= {201, 507}, set(statuses)
        assert statuses.count(201) > 100
        for k, v in locked.items():  # every worker may answer: all agree, the writer kept them
            for sess in sessions:
                assert await _get(sess, base, h, k) == v
        for i, lease in enumerate(leases):
            assert await _release(sessions[(i + 1) % 4], base, h, lease) == 204
    finally:
        for sess in sessions:
            await sess.close()

"""QoS between tenants over HTTP (issue 28): a tenant's ``qos`` on the admin
API, its limits on every path (the fast lane and the routes, reads, writes,
control calls, batches), ``429 rate_limited`` with ``Retry-After``, a limit
changed while traffic runs, limits across two workers, and the counters.

Limits are checked by what they let through and what they refuse, never by
how fast anything ran: a limit's lower bound on time (N bytes at R bytes/s
take at least N/R less the burst) holds however slow the machine is."""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kvstore_client.wire import batchframe

from kvstore.qos.buckets import BURST_S
from tests.http.conftest import ADMIN, Api, Daemon, daemon_env, free_port, serving
from tests.http.rawhttp import worker_connections
from tests.polling import until

KiB, MiB = 1 << 10, 1 << 20


async def _api(tmp_path: Path, **flags: str) -> AsyncIterator[Api]:
    async with serving(tmp_path, **flags) as api:
        yield api


@pytest.fixture
async def nowait(tmp_path: Path) -> AsyncIterator[Api]:
    """A server whose over-limit requests are refused at once (qos_max_wait_ms = 0)."""
    async for api in _api(tmp_path, qos_max_wait_ms="0"):
        yield api


@pytest.fixture
async def tiered(tmp_path: Path) -> AsyncIterator[Api]:
    """No waiting, and an object tier (a directory) that flush mirrors to."""
    async for api in _api(tmp_path, qos_max_wait_ms="0", tier_dir=str(tmp_path / "tier")):
        yield api


@pytest.fixture
async def waits(tmp_path: Path) -> AsyncIterator[Api]:
    """The default: over-limit requests wait up to a second."""
    async for api in _api(tmp_path):
        yield api


async def _admin(api: Api, method: str, path: str, body: object = None) -> tuple[int, dict[str, object]]:
    async with api.session.request(method, api.url(path), json=body, headers=api.auth(ADMIN)) as r:
        return r.status, await r.json()


async def test_qos_is_set_shown_patched_and_checked(nowait: Api) -> None:
    api = nowait
    await api.tenant("a", "direct", qos={"weight": 300, "read_bytes_per_s": 50_000_000})
    status, doc = await _admin(api, "GET", "/v1/admin/tenants/a")
    assert status == 200
    assert doc["qos"] == {"weight": 300, "read_bytes_per_s": 50_000_000, "write_bytes_per_s": 0, "requests_per_s": 0}
    assert set(doc["rates"]) == {"read_bytes_per_s", "write_bytes_per_s", "requests_per_s"}  # type: ignore[arg-type]
    status, doc = await _admin(api, "PATCH", "/v1/admin/tenants/a", {"qos": {"requests_per_s": 5}})
    assert status == 200
    assert doc["qos"] == {"weight": 300, "read_bytes_per_s": 50_000_000, "write_bytes_per_s": 0, "requests_per_s": 5}
    status, doc = await _admin(api, "PATCH", "/v1/admin/tenants/a", {"qos": {"weight": None}})
    assert doc["qos"]["weight"] == 100  # type: ignore[index]  # null: the store's default
    status, doc = await _admin(api, "PATCH", "/v1/admin/tenants/a", {"qos": None})
    assert doc["qos"] == {"weight": 100, "read_bytes_per_s": 0, "write_bytes_per_s": 0, "requests_per_s": 0}
    # A tenant created without qos shows the defaults; the list shows every tenant's.
    await api.tenant("b", "direct")
    status, doc = await _admin(api, "GET", "/v1/admin/tenants")
    assert {t["name"]: t["qos"]["weight"] for t in doc["tenants"]} == {"a": 100, "b": 100}  # type: ignore[attr-defined]
    bad: list[tuple[object, str]] = [
        ({"weight": 0}, "qos.weight"),
        ({"weight": 1001}, "qos.weight"),
        ({"weight": True}, "qos.weight"),
        ({"weight": 2.5}, "qos.weight"),
        ({"read_bytes_per_s": -1}, "qos.read_bytes_per_s"),
        ({"write_bytes_per_s": "fast"}, "qos.write_bytes_per_s"),
        ({"requests_per_s": 1 << 60}, "qos.requests_per_s"),
        ({"iops": 5}, "iops"),
        ([1, 2], "qos"),
        ("fast", "qos"),
    ]
    for qos, field in bad:
        for method, path, body in (
            ("PATCH", "/v1/admin/tenants/b", {"qos": qos}),
            ("POST", "/v1/admin/tenants", {"name": "c", "policy": "direct", "qos": qos}),
        ):
            status, doc = await _admin(api, method, path, body)
            assert status == 400, (qos, doc)
            assert doc["error"]["code"] == "invalid_input"  # type: ignore[index]
            assert field in doc["error"]["message"], (field, doc)  # type: ignore[index]
    status, doc = await _admin(api, "GET", "/v1/admin/tenants/b")
    assert doc["qos"]["weight"] == 100  # type: ignore[index]  # nothing half-applied
    status, _ = await _admin(api, "GET", "/v1/admin/tenants/c")
    assert status == 404


def _is_429(status: int, headers: object, doc: dict[str, object], field: str) -> None:
    assert status == 429, doc
    assert doc["error"]["code"] == "rate_limited"  # type: ignore[index]
    assert field in doc["error"]["message"]  # type: ignore[index]
    assert int(headers["Retry-After"]) >= 1  # type: ignore[index]


@pytest.mark.parametrize("lane", [True, False])
async def test_read_limit_refuses_past_the_burst_with_429_then_serves_again(nowait: Api, lane: bool) -> None:
    api = nowait
    token = await api.tenant("r", "direct", qos={"read_bytes_per_s": 1 * MiB})
    other = await api.tenant("o", "direct")
    data = os.urandom(512 * KiB)
    for t in (token, other):
        async with api.session.put(api.url("/v1/blocks/k"), data=data, headers=api.auth(t)) as r:
            assert r.status == 201
    # The fast lane answers a plain GET; a Range over two specs is the route's.
    headers = {} if lane else {"Range": "bytes=0-0,1-"}
    async with api.session.get(api.url("/v1/blocks/k"), headers={**api.auth(token), **headers}) as r:
        assert r.status == 200 and len(await r.read()) >= len(data)  # the bucket held 0.5 s: 512 KiB
    async with api.session.get(api.url("/v1/blocks/k"), headers={**api.auth(token), **headers}) as r:
        _is_429(r.status, r.headers, await r.json(), "read_bytes_per_s")
    # Another tenant is not limited by it.
    for _ in range(4):
        async with api.session.get(api.url("/v1/blocks/k"), headers=api.auth(other)) as r:
            assert r.status == 200 and await r.read() == data
    # HEAD and lookups take no read bytes.
    async with api.session.head(api.url("/v1/blocks/k"), headers=api.auth(token)) as r:
        assert r.status == 200
    async with api.session.post(api.url("/v1/lookup"), json={"keys": ["k"]}, headers=api.auth(token)) as r:
        assert r.status == 200
    await asyncio.sleep(0.6)
    async with api.session.get(api.url("/v1/blocks/k"), headers=api.auth(token)) as r:
        assert r.status == 200 and await r.read() == data


async def test_a_limited_tenant_waits_for_its_rate(waits: Api) -> None:
    """Over its limit a request waits (up to qos_max_wait_ms) instead of
    failing: 4 MiB at 2 MiB/s take at least 2 s less the burst."""
    api = waits
    rate = 2 * MiB
    token = await api.tenant("w", "direct", qos={"read_bytes_per_s": rate, "write_bytes_per_s": rate})
    data = os.urandom(512 * KiB)
    t0 = time.monotonic()
    for i in range(8):
        async with api.session.put(api.url(f"/v1/blocks/k{i}"), data=data, headers=api.auth(token)) as r:
            assert r.status == 201, await r.text()
    wrote = time.monotonic() - t0
    t0 = time.monotonic()
    for i in range(8):
        async with api.session.get(api.url(f"/v1/blocks/k{i}"), headers=api.auth(token)) as r:
            assert r.status == 200 and await r.read() == data
    read = time.monotonic() - t0
    least = (8 * len(data) - rate * BURST_S - len(data)) / rate  # the burst, and the first block passes
    assert wrote >= least and read >= least, (wrote, read, least)
    m = await (await api.session.get(api.url("/metrics"))).text()
    assert 'kvstore_tenant_throttled_seconds_total{tenant="w"}' in m


async def test_write_limit_refuses_before_the_body_is_kept(nowait: Api) -> None:
    api = nowait
    token = await api.tenant("w", "direct", qos={"write_bytes_per_s": 1 * MiB})
    data = os.urandom(1 * MiB)
    async with api.session.put(api.url("/v1/blocks/a"), data=data, headers=api.auth(token)) as r:
        assert r.status == 201  # a full bucket lets one block through, whatever its size
    for path in ("/v1/blocks/b", "/v1/blocks/c"):
        async with api.session.put(api.url(path), data=data, headers=api.auth(token)) as r:
            _is_429(r.status, r.headers, await r.json(), "write_bytes_per_s")
    for key, want in (("a", 200), ("b", 404), ("c", 404)):
        async with api.session.get(api.url(f"/v1/blocks/{key}"), headers=api.auth(token)) as r:
            assert r.status == want
    m = await (await api.session.get(api.url("/metrics"))).text()
    assert 'kvstore_tenant_rate_limited_total{tenant="w"} 2' in m
    assert "kvstore_http_buffered_body_bytes 0" in m


async def test_requests_per_s_limits_control_calls_too(nowait: Api) -> None:
    api = nowait
    token = await api.tenant("q", "direct", qos={"requests_per_s": 2})
    other = await api.tenant("o", "direct")
    calls = [
        ("POST", "/v1/lookup", {"keys": ["x"]}),
        ("HEAD", "/v1/blocks/x", None),
        ("GET", "/v1/stats", None),
    ]
    for method, path, body in calls:
        await asyncio.sleep(1.0)  # the bucket full again: one request (rate 2/s holds 1)
        async with api.session.request(method, api.url(path), json=body, headers=api.auth(token)) as r:
            assert r.status in (200, 404), (method, path, r.status)
        async with api.session.request(method, api.url(path), json=body, headers=api.auth(token)) as r:
            assert r.status == 429, (method, path, r.status)
            assert int(r.headers["Retry-After"]) >= 1
        async with api.session.request(method, api.url(path), json=body, headers=api.auth(other)) as r:
            assert r.status in (200, 404)


async def test_batches_answer_429_items_past_the_limit(nowait: Api) -> None:
    api = nowait
    token = await api.tenant("b", "direct", qos={"read_bytes_per_s": 1 * MiB})
    data = os.urandom(512 * KiB)
    for i in range(3):
        async with api.session.put(api.url(f"/v1/blocks/k{i}"), data=data, headers=api.auth(token)) as r:
            assert r.status == 201
    async with api.session.post(
        api.url("/v1/batch/get"), json={"keys": ["k0", "k1", "k2"]}, headers=api.auth(token)
    ) as r:
        assert r.status == 200
        items = [item async for item in batchframe.read_get_items(r.content)]
    assert [status for _, status, _ in items] == [200, 429, 429]
    assert items[0][2] == data and json.loads(items[1][2])["code"] == "rate_limited"


async def test_a_limit_changed_while_traffic_runs_applies_to_the_next_requests(nowait: Api) -> None:
    """Four readers run while a read limit is set and lifted. The requests
    that start after each PATCH is answered meet the new policy, counted by
    the time they really took (the daemon's buckets use the real clock):
    over ``T`` seconds a tenant moves at most rate * (T + BURST_S) plus one
    request (kvstore/qos/buckets.py), however slow the machine; the bucket's
    arithmetic itself is tested on a fake clock (tests/unit/test_qos_core.py)."""
    api = nowait
    token = await api.tenant("p", "direct")
    rate, data = 256 * KiB, os.urandom(256 * KiB)  # a block of one second of the limit
    async with api.session.put(api.url("/v1/blocks/k"), data=data, headers=api.auth(token)) as r:
        assert r.status == 201
    answers: list[tuple[float, float, int]] = []  # started, answered, status
    stop = asyncio.Event()

    async def reader() -> None:
        while not stop.is_set():
            started = time.monotonic()
            async with api.session.get(api.url("/v1/blocks/k"), headers=api.auth(token)) as r:
                body = await r.read()
                answers.append((started, time.monotonic(), r.status))
                assert r.status == 429 or body == data

    def since(t: float) -> list[int]:
        return [status for started, _, status in answers if started >= t]

    def took(t: float) -> float:
        """Seconds from ``t`` to the last answer of a request started since."""
        return max((answered for started, answered, _ in answers if started >= t), default=t) - t

    def most_passing(t: float) -> float:
        """The most 200s the limit allows to requests started since ``t``."""
        return rate * (took(t) + BURST_S) / len(data) + 1

    tasks = [asyncio.create_task(reader()) for _ in range(4)]
    try:
        await until("8 reads before any limit", lambda: len(answers) >= 8)
        assert {status for _, _, status in answers} == {200}
        status, _ = await _admin(api, "PATCH", "/v1/admin/tenants/p", {"qos": {"read_bytes_per_s": rate}})
        assert status == 200
        limited = time.monotonic()
        # Refused past the limit, and served again as the bucket refills, for
        # two seconds at least (a few refills): how many passed is bounded by
        # the time that really took.
        await until(
            "two seconds of reads, refused and passing",
            lambda: took(limited) >= 2.0 and set(since(limited)) == {200, 429},
        )
        after = since(limited)
        assert after.count(200) <= most_passing(limited), (after.count(200), most_passing(limited))
        status, _ = await _admin(api, "PATCH", "/v1/admin/tenants/p", {"qos": {"read_bytes_per_s": None}})
        assert status == 200
        lifted = time.monotonic()
        await until("8 reads after the limit is lifted", lambda: len(since(lifted)) >= 8)
        assert set(since(lifted)) == {200}
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_limits_hold_across_two_workers(tmp_path: Path) -> None:
    """The node's limit, not each worker's: what one worker served leaves the
    other nothing until the bucket refills."""
    env = daemon_env(tmp_path, segment_size="1MiB", frame_size="64KiB", qos_max_wait_ms="0")
    daemon = Daemon(tmp_path / "data", free_port(), env, extra=["--workers", "2"], log_dir=tmp_path)
    daemon.start()
    try:
        conns = await worker_connections("127.0.0.1", daemon.port)
        try:
            w, r = conns["writer"], conns["reader"]
            admin = {"Authorization": f"Bearer {ADMIN}"}
            body = {"name": "t", "policy": "direct", "qos": {"read_bytes_per_s": 1 * MiB, "requests_per_s": 0}}
            reply = await w.request("POST", "/v1/admin/tenants", admin, json.dumps(body).encode())
            assert reply.status == 201, reply.body
            auth = {"Authorization": f"Bearer {reply.json()['token']}"}
            data = os.urandom(512 * KiB)
            assert (await w.request("PUT", "/v1/blocks/k", auth, data)).status == 201
            await asyncio.sleep(0.6)
            for first, second in ((w, r), (r, w)):
                await asyncio.sleep(0.6)  # full again
                got = await first.request("GET", "/v1/blocks/k", auth)
                assert got.status == 200 and got.body == data
                got = await second.request("GET", "/v1/blocks/k", auth)
                assert got.status == 429 and got.code == "rate_limited", got.body
            # Writes relayed by the reader are limited once, on the writer.
            patch = json.dumps({"qos": {"read_bytes_per_s": None, "write_bytes_per_s": 1 * MiB}}).encode()
            assert (await r.request("PATCH", "/v1/admin/tenants/t", admin, patch)).status == 200
            await asyncio.sleep(0.6)
            assert (await r.request("PUT", "/v1/blocks/a", auth, data)).status == 201
            got = await w.request("PUT", "/v1/blocks/b", auth, data)
            assert got.status == 429 and "write_bytes_per_s" in got.body.decode()
            # And the reader saw the PATCH: its reads are no longer limited.
            for _ in range(3):
                assert (await r.request("GET", "/v1/blocks/k", auth)).status == 200
        finally:
            for c in conns.values():
                await c.close()
    finally:
        daemon.stop()


async def test_maintenance_is_not_charged_to_tenants_and_limits_hold_while_it_runs(tiered: Api) -> None:
    """Compaction and mirroring copy a tenant's records; they take none of its
    tokens (maintenance has its own rate, compact_rate), and its limits keep
    applying to its own requests while they run."""
    api = tiered
    token = await api.tenant("m", "direct", qos={"read_bytes_per_s": 1 * MiB})
    data = os.urandom(256 * KiB)
    for i in range(16):
        async with api.session.put(api.url(f"/v1/blocks/k{i}"), data=data, headers=api.auth(token)) as r:
            assert r.status == 201
    for i in range(0, 16, 2):
        async with api.session.delete(api.url(f"/v1/blocks/k{i}"), headers=api.auth(token)) as r:
            assert r.status == 204
    await asyncio.sleep(0.6)  # the bucket full: 512 KiB

    async def reads() -> list[int]:
        out = []
        for i in range(1, 16, 2):
            async with api.session.get(api.url(f"/v1/blocks/k{i}"), headers=api.auth(token)) as r:
                body = await r.read()
                assert r.status == 429 or body == data
                out.append(r.status)
        return out

    compact = _admin(api, "POST", "/v1/admin/compact")
    flush = _admin(api, "POST", "/v1/admin/flush")
    (cs, report), (fs, _), statuses = await asyncio.gather(compact, flush, reads())
    assert cs == 200 and report["segments_rewritten"] >= 1, report
    assert fs == 200
    # The burst (two blocks) passed, the rest waited for the rate: refused.
    assert statuses[:2] == [200, 200] and 429 in statuses[2:], statuses
    await asyncio.sleep(0.6)
    # What compaction and the upload moved was not the tenant's: its bucket is full again.
    for i in (1, 3):
        async with api.session.get(api.url(f"/v1/blocks/k{i}"), headers=api.auth(token)) as r:
            assert r.status == 200 and await r.read() == data


async def test_the_client_takes_a_throttled_load_for_a_miss_and_strict_mode_sees_429(nowait: Api) -> None:
    """What the engine adapters see: a load refused by the tenant's limit is
    a miss in the default fail-open mode (counted as an error, not raised),
    and a 429 rate_limited with its Retry-After in strict mode."""
    from kvstore_client import AsyncClient
    from kvstore_client.errors import ServerError

    api = nowait
    token = await api.tenant("c", "direct", qos={"read_bytes_per_s": 1 * MiB})
    data = os.urandom(512 * KiB)
    async with api.session.put(api.url("/v1/blocks/k"), data=data, headers=api.auth(token)) as r:
        assert r.status == 201
    async with AsyncClient(api.base, token, timeout=0.5, retries=0, read_plans=False) as kv:
        assert await kv.get("k") == data
        assert await kv.get("k") is None  # throttled: a miss, never an exception
        assert kv.stats["errors"] >= 1
    async with AsyncClient(api.base, token, timeout=0.5, retries=0, strict=True, read_plans=False) as kv:
        with pytest.raises(ServerError) as err:
            await kv.get("k")
        assert (err.value.status, err.value.code) == (429, "rate_limited")
        assert err.value.retry_after is not None and err.value.retry_after >= 1


async def test_batch_puts_and_records_are_limited_too(nowait: Api) -> None:
    """A batch PUT's items past the write limit are 429 items, the others
    stored; a record (GET /v1/records, loopback) takes its bytes from the
    read limit like a block GET."""
    api = nowait
    token = await api.tenant("b", "sealed", qos={"write_bytes_per_s": 1 * MiB, "read_bytes_per_s": 1 * MiB})
    data = [os.urandom(512 * KiB) for _ in range(3)]
    body = io.BytesIO(batchframe.encode_put_stream([(f"k{i}", d) for i, d in enumerate(data)]))
    headers = {**api.auth(token), "Content-Type": "application/x-kvstore-batch"}
    async with api.session.post(api.url("/v1/batch/put"), data=body, headers=headers) as r:
        assert r.status == 200
        results = (await r.json())["results"]
    assert [x["status"] for x in results] == [201, 429, 429]
    assert results[1]["error"]["code"] == "rate_limited"
    for key, want in (("k0", 200), ("k1", 404), ("k2", 404)):
        async with api.session.get(api.url(f"/v1/blocks/{key}"), headers=api.auth(token)) as r:
            assert r.status == want
    async with api.session.get(api.url("/v1/records/k0"), headers=api.auth(token)) as r:
        assert r.status == 429 and r.headers["Retry-After"]  # the GET of k0 above took the burst
    await asyncio.sleep(0.6)
    async with api.session.get(api.url("/v1/records/k0"), headers=api.auth(token)) as r:
        assert r.status == 200
    async with api.session.get(api.url("/v1/records/k0"), headers=api.auth(token)) as r:
        assert r.status == 429

"""Admission (issue 41): a tenant with ``admit_after`` N stores a block it
does not hold only at its N-th offer within ``admit_window_s``; the offers
before are answered ``202`` (nothing stored, no ETag), on every write path,
and counted in ``/metrics`` ("admission counted")."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvstore_client import AsyncClient
from kvstore_client.nixl import nixl_available
from kvstore_client.plans import PlanConnection
from kvstore_client.wire import batchframe

from .conftest import ADMIN, Api, Daemon, serving
from .openapi import Spec
from .rawhttp import worker_connections

NOT_ADMITTED = 202


def _value(text: str, series: str) -> float:
    m = re.search("^" + re.escape(series) + r" (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def _metrics(api: Api) -> str:
    async with api.session.get(api.url("/metrics")) as r:
        return await r.text()


async def _put(api: Api, tenant: str, key: str, data: bytes = b"x" * 5000) -> tuple[int, dict[str, Any], str | None]:
    async with api.session.put(api.url(f"/v1/blocks/{key}"), data=data, headers=api.auth(api.tokens[tenant])) as r:
        return r.status, await r.json(), r.headers.get("ETag")


async def _get(api: Api, tenant: str, key: str) -> int:
    async with api.session.get(api.url(f"/v1/blocks/{key}"), headers=api.auth(api.tokens[tenant])) as r:
        return r.status


async def _admin(api: Api, method: str, path: str, body: object) -> tuple[int, dict[str, Any]]:
    async with api.session.request(method, api.url(path), json=body, headers=api.auth(ADMIN)) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("lane", ["false", "true"])
async def test_a_block_is_stored_at_its_second_offer_and_counted(tmp_path: Path, lane: str) -> None:
    """On the route and on the fast lane: the first PUT is 202 with no ETag
    and stores nothing; the second is 201; /metrics counts both."""
    async with serving(tmp_path, fast_lane=lane) as api:
        await api.tenant("a", admit_after=2)
        status, doc, etag = await _put(api, "a", "k1")
        assert status == NOT_ADMITTED and etag is None
        assert doc == {"key": "k1", "admitted": False, "offers": 1, "admit_after": 2}
        assert await _get(api, "a", "k1") == 404
        status, doc, etag = await _put(api, "a", "k1")
        assert status == 201 and doc["created"] is True and etag is not None
        assert await _get(api, "a", "k1") == 200
        status, _, _ = await _put(api, "a", "k1")
        assert status == 200  # held now: a PUT of it is answered as always, not counted
        text = await _metrics(api)
    assert _value(text, 'kvstore_tenant_admission_total{result="declined",tenant="a"}') == 1
    assert _value(text, 'kvstore_tenant_admission_total{result="admitted",tenant="a"}') == 1
    assert _value(text, 'kvstore_tenant_admission_bytes_total{result="declined",tenant="a"}') == 5000


async def test_the_fast_lane_answers_the_documented_body(tmp_path: Path) -> None:
    async with serving(tmp_path, fast_lane="true") as api:
        await api.tenant("a", admit_after=2)
        status, doc, _ = await _put(api, "a", "k1")
    assert status == NOT_ADMITTED
    assert doc == {"key": "k1", "admitted": False, "offers": 1, "admit_after": 2}


async def test_admit_after_1_stores_every_block_at_once(api: Api) -> None:
    await api.tenant("a")
    status, doc, etag = await _put(api, "a", "k")
    assert status == 201 and doc["created"] and etag
    _, t = await _admin(api, "GET", "/v1/admin/tenants/a", None)
    assert t["admit_after"] == 1 and t["admit_window_s"] == 3600
    assert "kvstore_tenant_admission_total" not in await _metrics(api)


async def test_offers_count_within_the_window_only(api: Api) -> None:
    await api.tenant("a", admit_after=2, admit_window_s=1)
    assert (await _put(api, "a", "k"))[0] == NOT_ADMITTED
    await asyncio.sleep(1.1)  # past the window of the first offer: the next one is a first again
    assert (await _put(api, "a", "k"))[0] == NOT_ADMITTED  # (within the window it would be stored)
    assert (await _put(api, "a", "k"))[0] == 201


async def test_bad_values_are_refused_naming_the_field(api: Api) -> None:
    await api.tenant("a")
    for field, bad in (
        ("admit_after", 0),
        ("admit_after", 17),
        ("admit_after", "2"),
        ("admit_after", True),
        ("admit_after", 2.5),
        ("admit_window_s", 0),
        ("admit_window_s", 8 * 86_400),
        ("admit_window_s", "60"),
    ):
        for method, path, body in (
            ("POST", "/v1/admin/tenants", {"name": "b", field: bad}),
            ("PATCH", "/v1/admin/tenants/a", {field: bad}),
        ):
            status, doc = await _admin(api, method, path, body)
            assert status == 400 and doc["error"]["code"] == "invalid_input", (method, field, bad, doc)
            assert field in doc["error"]["message"]
    status, _ = await _admin(api, "GET", "/v1/admin/tenants/b", None)
    assert status == 404  # no refused creation made it


async def test_patch_changes_admission_and_null_puts_it_back(api: Api) -> None:
    await api.tenant("a")
    status, t = await _admin(api, "PATCH", "/v1/admin/tenants/a", {"admit_after": 3, "admit_window_s": 120})
    assert status == 200 and (t["admit_after"], t["admit_window_s"]) == (3, 120)
    assert [(await _put(api, "a", "k"))[0] for _ in range(3)] == [NOT_ADMITTED, NOT_ADMITTED, 201]
    assert (await _put(api, "a", "j"))[0] == NOT_ADMITTED
    status, t = await _admin(api, "PATCH", "/v1/admin/tenants/a", {"admit_after": None, "admit_window_s": None})
    assert status == 200 and (t["admit_after"], t["admit_window_s"]) == (1, 3600)
    assert (await _put(api, "a", "j"))[0] == 201


async def test_a_batch_put_answers_each_block(api: Api) -> None:
    await api.tenant("a", admit_after=2)
    assert (await _put(api, "a", "held"))[0] == NOT_ADMITTED
    assert (await _put(api, "a", "held"))[0] == 201
    body = batchframe.encode_put_stream([("held", b"1"), ("b1", b"2" * 100), ("b2", b"3" * 50)])
    for expected in ([200, NOT_ADMITTED, NOT_ADMITTED], [200, 201, 201]):
        async with api.session.post(api.url("/v1/batch/put"), data=body, headers=api.auth(api.tokens["a"])) as r:
            assert r.status == 200
            results = (await r.json())["results"]
        assert [x["status"] for x in results] == expected
    assert results[1] == {"key": "b1", "status": 201}


async def test_a_batch_put_item_not_admitted_says_so(api: Api) -> None:
    await api.tenant("a", admit_after=3)
    body = batchframe.encode_put_stream([("b1", b"2" * 100)])
    async with api.session.post(api.url("/v1/batch/put"), data=body, headers=api.auth(api.tokens["a"])) as r:
        results = (await r.json())["results"]
    assert results == [{"key": "b1", "status": 202, "admitted": False, "offers": 1, "admit_after": 3}]


async def test_the_client_takes_a_block_not_admitted_as_not_stored_not_failed(api: Api) -> None:
    await api.tenant("a", admit_after=2)
    for strict in (True, False):  # strict: it does not raise either
        async with AsyncClient(api.base, api.tokens["a"], strict=strict) as kv:
            key = f"c{strict}"
            assert await kv.put(key, b"v" * 1000) is False
            assert kv.stats["puts_not_admitted"] == 1 and kv.stats["put_failures"] == 0
            assert kv.stats["errors"] == 0 and kv.stats["retries"] == 0  # not retried: that would be an offer
            assert await kv.get(key) is None
            assert await kv.put(key, b"v" * 1000) is True
            assert await kv.get(key) == b"v" * 1000
            items = [(f"m{strict}{i}", b"m" * 300) for i in range(3)]
            assert await kv.put_many_detail(items) == [202, 202, 202]
            assert await kv.put_many(items) == [True, True, True]
            assert kv.stats["puts_not_admitted"] == 4 and kv.stats["put_failures"] == 0


async def test_the_gateway_prefixes_stay_refused_to_clients(api: Api) -> None:
    """The S3 gateway's blocks are exempt from admission (engine/admission.py):
    clients cannot write under its prefixes, so they cannot use that to
    bypass it."""
    await api.tenant("a", admit_after=2)
    status, doc, _ = await _put(api, "a", "s3~x~0")
    assert status == 400 and doc["error"]["code"] == "invalid_key"


async def test_counted_by_the_writer_for_every_worker_and_kept_across_a_restart(daemon: Daemon) -> None:
    """Two workers: offers arrive on either (a reader relays the PUT to the
    writer, which counts); the setting survives a restart (the counts do not)."""
    daemon.extra = ["--workers", "2"]
    daemon.start()
    base = daemon.base
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with aiohttp.ClientSession() as s:
        body = {"name": "w", "policy": "direct", "admit_after": 2, "admit_window_s": 600}
        async with s.post(f"{base}/v1/admin/tenants", json=body, headers=admin) as r:
            assert r.status == 201
            auth = {"Authorization": f"Bearer {(await r.json())['token']}"}
    # A connection to each worker (they share the socket: new connections reach
    # either, as the kernel decides); each key offered once through each.
    conns = await worker_connections("127.0.0.1", daemon.port)
    try:
        for i in range(6):
            order = ("reader", "writer") if i % 2 else ("writer", "reader")
            statuses = [
                (await conns[role].request("PUT", f"/v1/blocks/k{i}", auth, b"z" * 3000)).status for role in order
            ]
            assert statuses == [NOT_ADMITTED, 201], (i, order)
    finally:
        for conn in conns.values():
            await conn.close()
    daemon.stop()
    daemon.start()
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/v1/admin/tenants/w", headers=admin) as r:
            t = await r.json()
        assert (t["admit_after"], t["admit_window_s"]) == (2, 600)
        async with s.put(f"{base}/v1/blocks/k0", data=b"z" * 3000, headers=auth) as r:
            assert r.status == 200  # stored before the restart
        async with s.put(f"{base}/v1/blocks/new", data=b"z" * 3000, headers=auth) as r:
            assert r.status == NOT_ADMITTED


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install --no-deps nixl-cu12 nixl)")
async def test_nixl_writes_answer_each_block_and_pull_a_direct_one_only_once_admitted(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct tenant's blocks are declined before any byte is pulled into
    its segment (from memory never registered, even); a sealed tenant's are
    pulled into staging, then declined.
    The client takes the 202 items as not stored, and does not fall back to
    HTTP (which would be another offer)."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "tcp")
    _start_nixl(daemon)
    base = daemon.base
    spec = Spec.load()
    async with aiohttp.ClientSession() as s:
        for policy in ("direct", "sealed"):
            body = {"name": f"n{policy}", "policy": policy, "admit_after": 2}
            async with s.post(f"{base}/v1/admin/tenants", json=body, headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                token = (await r.json())["token"]
            blocks = [(f"n{policy}{i}", bytes([i]) * (70_000 + i)) for i in range(3)]
            async with AsyncClient(base, token, transport="nixl", timeout=10) as c:
                assert await c.put_many_detail(blocks) == [202] * 3
                assert c.stats["nixl_writes"] == 3 and c.stats["nixl_fallbacks"] == 0
                assert c.stats["puts_not_admitted"] == 3 and c.stats["put_failures"] == 0
                assert await c.get_many([k for k, _ in blocks]) == [None] * 3
                if policy == "direct":  # declined before any byte is pulled: even from memory never registered
                    landed = await _nixl_written(s, base)
                    assert landed.get("segment", 0) == 0, landed  # nothing pulled into a segment yet
                    blk = {"key": "ndirect-raw", "addr": 4096, "len": 5000, "dev": 0}
                    doc = {"agent": c._nixl.agent().name, "blocks": [blk]}
                    async with s.post(
                        f"{base}/v1/xfer/write", json=doc, headers={"Authorization": f"Bearer {token}"}
                    ) as r:
                        raw = await r.read()
                        assert r.status == 200, raw
                    assert spec.problems("POST", "/v1/xfer/write", 200, "application/json", raw) == []
                    item = json.loads(raw)["results"][0]
                    assert item == {
                        "key": "ndirect-raw",
                        "status": 202,
                        "admitted": False,
                        "offers": 1,
                        "admit_after": 2,
                    }
                assert await c.put_many_detail(blocks) == [201] * 3
                assert await c.get_many([k for k, _ in blocks]) == [v for _, v in blocks]
        landed = await _nixl_written(s, base)
        assert landed.get("segment", 0) >= 3 * 70_000, landed  # the direct tenant's, once admitted


def _start_nixl(daemon: Daemon) -> None:
    daemon.env |= {"KVSTORE_NIXL": "1", "KVSTORE_NIXL_DEVICES": "lo", "UCX_TLS": "tcp"}
    daemon.extra = ["--compact-interval-s", "0"]
    daemon.start()


async def _nixl_written(s: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """kvstore_nixl_bytes_total{op="write"} by source."""
    async with s.get(f"{base}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvstore_nixl_bytes_total{") and 'op="write"' in line:
            source = line.split('source="')[1].split('"')[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


async def test_write_plans_count_the_offer_and_leave_nothing_to_write(daemon: Daemon, sock_dir: Path) -> None:
    """On the unix socket a direct tenant's put_many goes through write plans:
    a block not admitted is a 202 item of the plan, with no room reserved,
    and the client neither writes it nor sends it over HTTP instead."""
    sock = _start_plans(daemon, sock_dir)
    async with aiohttp.ClientSession() as s:
        body = {"name": "p", "policy": "direct", "admit_after": 2}
        async with s.post(
            f"{daemon.base}/v1/admin/tenants", json=body, headers={"Authorization": f"Bearer {ADMIN}"}
        ) as r:
            token = (await r.json())["token"]
    blocks = [(f"p{i}", bytes([i + 1]) * (50_000 + i)) for i in range(3)]
    async with AsyncClient(f"unix:{sock}", token, timeout=10) as c:
        assert await c.put_many_detail(blocks) == [202] * 3
        assert c.stats["plan_writes"] == 0 and c.stats["plan_fallbacks"] == 0
        assert c.stats["puts_not_admitted"] == 3 and c.stats["put_failures"] == 0
        assert await c.put_many_detail(blocks) == [201] * 3
        assert c.stats["plan_writes"] == 3 and c.stats["plan_fallbacks"] == 0
        assert await c.get_many([k for k, _ in blocks]) == [v for _, v in blocks]
    conn = PlanConnection(sock, token)
    try:
        doc, fds = conn.plan_writes([{"key": "q", "size": 5000}])
        assert fds == [] and doc["blocks"] == [
            {"key": "q", "status": 202, "admitted": False, "offers": 1, "admit_after": 2}
        ]
    finally:
        conn.close()


def _start_plans(daemon: Daemon, sock_dir: Path) -> str:
    sock = str(sock_dir / "kv.sock")
    daemon.extra = ["--listen", f"unix:{sock}", "--unix-socket-mode", "0666", "--compact-interval-s", "0"]
    daemon.start()
    return sock

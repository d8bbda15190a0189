"""Every route and status of the v1 contract, against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
from pathlib import Path

import aiohttp
import pytest
from kvstore_client.wire import batchframe

from tests.http.conftest import ADMIN, Api

KV = (hashlib.sha256(b"seed").digest() * 8192)[:200_000]  # 200 KB: several 64 KiB frames


async def test_health_ready_metrics(api: Api) -> None:
    async with api.session.get(api.url("/healthz")) as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    async with api.session.get(api.url("/readyz")) as r:
        assert r.status == 200 and await r.json() == {"status": "ready"}  # the report needs the admin token
    async with api.session.get(api.url("/readyz"), headers=api.auth(ADMIN)) as r:
        assert r.status == 200 and "recovery" in await r.json()
    t = await api.tenant("alice")
    async with api.session.put(api.url("/v1/blocks/k"), data=b"x" * 10, headers=api.auth(t)) as r:
        assert r.status == 201
    async with api.session.get(api.url("/v1/blocks/k"), headers=api.auth(t)) as r:
        assert r.status == 200
    async with api.session.get(api.url("/metrics")) as r:
        text = await r.text()
    assert r.status == 200
    for needle in (
        'kvstore_http_requests_total{method="PUT",route="/v1/blocks/{key}",status="201"} 1',
        "kvstore_http_request_seconds_bucket",
        'kvstore_blocks{tier="g3"} 1',
        "kvstore_fsync_seconds_count",
        "kvstore_http_bytes_in_total 10",
        "kvstore_lookups_total",
        "kvstore_batch_records_bucket",
        "kvstore_recovery_corrupt_records 0",
    ):
        assert needle in text, needle


async def test_put_get_head_delete(api: Api) -> None:
    h = api.auth(await api.tenant("alice"))
    async with api.session.put(api.url("/v1/blocks/blk"), data=KV, headers=h) as r:
        assert r.status == 201
        etag = r.headers["ETag"]
        assert (await r.json()) == {"key": "blk", "size": len(KV), "created": True}
    async with api.session.put(api.url("/v1/blocks/blk"), data=b"other", headers=h) as r:
        assert r.status == 200 and r.headers["ETag"] == etag  # first write wins
    async with api.session.get(api.url("/v1/blocks/blk"), headers=h) as r:
        assert r.status == 200 and await r.read() == KV
        assert r.headers["ETag"] == etag and r.headers["Accept-Ranges"] == "bytes"
    async with api.session.head(api.url("/v1/blocks/blk"), headers=h) as r:
        assert r.status == 200 and int(r.headers["Content-Length"]) == len(KV) and r.headers["ETag"] == etag
        assert await r.read() == b""
    async with api.session.get(api.url("/v1/blocks/blk"), headers={**h, "If-None-Match": etag}) as r:
        assert r.status == 304 and r.headers["ETag"] == etag
    async with api.session.get(api.url("/v1/blocks/blk"), headers={**h, "If-None-Match": '"nope"'}) as r:
        assert r.status == 200
    async with api.session.delete(api.url("/v1/blocks/blk"), headers=h) as r:
        assert r.status == 204
    for method in ("GET", "HEAD", "DELETE"):
        async with api.session.request(method, api.url("/v1/blocks/blk"), headers=h) as r:
            assert r.status == 404
            if method != "HEAD":
                assert (await r.json())["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("header", "status", "expect"),
    [
        ("bytes=0-99", 206, slice(0, 100)),
        ("bytes=65530-65545", 206, slice(65530, 65546)),  # across a frame boundary
        ("bytes=199990-", 206, slice(199990, None)),
        ("bytes=-10", 206, slice(-10, None)),
        ("bytes=100-999999", 206, slice(100, None)),  # last clamped
        ("bytes=0-1,5-6", 200, slice(None)),  # several ranges: the whole block
        ("bytes=abc", 200, slice(None)),  # malformed: ignored
        ("bytes=5-1", 200, slice(None)),
        ("pages=0-1", 200, slice(None)),
    ],
)
async def test_ranges(api: Api, header: str, status: int, expect: slice) -> None:
    h = api.auth(await api.tenant("alice"))
    await api.session.put(api.url("/v1/blocks/r"), data=KV, headers=h)
    async with api.session.get(api.url("/v1/blocks/r"), headers={**h, "Range": header}) as r:
        assert r.status == status
        assert await r.read() == KV[expect]
        if status == 206:
            first = range(len(KV))[expect][0]
            assert r.headers["Content-Range"] == f"bytes {first}-{first + len(KV[expect]) - 1}/{len(KV)}"


async def test_unsatisfiable_range(api: Api) -> None:
    h = api.auth(await api.tenant("alice"))
    await api.session.put(api.url("/v1/blocks/r"), data=b"0123456789", headers=h)
    for header in ("bytes=10-20", "bytes=-0"):
        async with api.session.get(api.url("/v1/blocks/r"), headers={**h, "Range": header}) as r:
            assert r.status == 416 and r.headers["Content-Range"] == "bytes */10"
            assert (await r.json())["error"]["code"] == "range_not_satisfiable"


async def test_lookup_and_stats(api: Api) -> None:
    h = api.auth(await api.tenant("alice"))
    chain = [f"c{i}" for i in range(8)]
    for k in chain[:5]:
        await api.session.put(api.url(f"/v1/blocks/{k}"), data=k.encode() * 100, headers=h)
    await api.session.delete(api.url("/v1/blocks/c3"), headers=h)
    async with api.session.post(api.url("/v1/lookup"), json={"keys": chain}, headers=h) as r:
        assert r.status == 200
        assert await r.json() == {"prefix": 3, "present": [True, True, True, False, True, False, False, False]}
    async with api.session.get(api.url("/v1/stats"), headers=h) as r:
        s = await r.json()
    assert s["blocks"] == 4 and s["bytes_logical"] == 4 * 200 and s["bytes_stored"] >= 4 * 4096


async def test_batch_put_and_get(api: Api) -> None:
    h = api.auth(await api.tenant("alice"))
    items = [(f"b{i}", KV[i * 1000 : i * 1000 + 70_000 + i]) for i in range(20)]
    body = io.BytesIO(batchframe.encode_put_stream(items))
    async with api.session.post(api.url("/v1/batch/put"), data=body, headers=h) as r:
        assert r.status == 200
        results = (await r.json())["results"]
    assert [x["status"] for x in results] == [201] * 20
    async with api.session.post(api.url("/v1/batch/put"), data=batchframe.encode_put_stream(items[:2]), headers=h) as r:
        assert [x["status"] for x in (await r.json())["results"]] == [200, 200]
    keys = [k for k, _ in items] + ["absent", "b0"]
    async with api.session.post(api.url("/v1/batch/get"), json={"keys": keys}, headers=h) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("application/x-kvstore-batch")
        got = [item async for item in batchframe.read_get_items(r.content)]
    assert [(k, s) for k, s, _ in got] == [(k, 200) for k, _ in items] + [("absent", 404), ("b0", 200)]
    for (k, _, data), (_, want) in zip(got, items, strict=False):
        assert data == want, k
    assert json.loads(got[-2][2])["code"] == "not_found"


async def test_tenant_isolation_and_token_lifecycle(api: Api) -> None:
    a, b = await api.tenant("alice"), await api.tenant("bob")
    await api.session.put(api.url("/v1/blocks/secret"), data=b"alice", headers=api.auth(a))
    async with api.session.get(api.url("/v1/blocks/secret"), headers=api.auth(b)) as r:
        assert r.status == 404  # as if absent
    async with api.session.post(api.url("/v1/lookup"), json={"keys": ["secret"]}, headers=api.auth(b)) as r:
        assert (await r.json())["present"] == [False]
    # A second token works; revoking it leaves the first one working.
    async with api.session.post(api.url("/v1/admin/tenants/alice/tokens"), headers=api.auth(ADMIN)) as r:
        assert r.status == 201
        second = await r.json()
    async with api.session.get(api.url("/v1/blocks/secret"), headers=api.auth(second["token"])) as r:
        assert r.status == 200 and await r.read() == b"alice"
    async with api.session.delete(
        api.url(f"/v1/admin/tenants/alice/tokens/{second['token_id']}"), headers=api.auth(ADMIN)
    ) as r:
        assert r.status == 204
    async with api.session.get(api.url("/v1/blocks/secret"), headers=api.auth(second["token"])) as r:
        assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    async with api.session.get(api.url("/v1/blocks/secret"), headers=api.auth(a)) as r:
        assert r.status == 200
    # Deleting the tenant crypto-shreds it: its token fails from then on.
    async with api.session.delete(api.url("/v1/admin/tenants/alice"), headers=api.auth(ADMIN)) as r:
        assert r.status == 204
    async with api.session.get(api.url("/v1/blocks/secret"), headers=api.auth(a)) as r:
        assert r.status == 401
    async with api.session.get(api.url("/v1/stats"), headers=api.auth(b)) as r:
        assert r.status == 200


async def test_auth_failures(api: Api) -> None:
    await api.tenant("alice")
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}, api.auth("")):
        async with api.session.get(api.url("/v1/blocks/k"), headers=headers) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
    tenant = api.tokens["alice"]
    for method, path in (
        ("GET", "/v1/admin/tenants"),
        ("POST", "/v1/admin/tenants"),
        ("DELETE", "/v1/admin/tenants/x"),
    ):
        async with api.session.request(method, api.url(path), headers=api.auth(tenant)) as r:
            assert r.status == 401  # a tenant token is not an admin token


async def test_admin_routes(api: Api, tmp_path: object) -> None:
    adm = api.auth(ADMIN)
    async with api.session.post(api.url("/v1/admin/tenants"), json={"name": "d", "policy": "direct"}, headers=adm) as r:
        body = await r.json()
        assert r.status == 201 and body["policy"] == "direct" and body["token"].startswith("kvs_")
    async with api.session.post(api.url("/v1/admin/tenants"), json={"name": "d"}, headers=adm) as r:
        assert r.status == 409 and (await r.json())["error"]["code"] == "tenant_exists"
    for bad, field in (
        ({"name": "x", "policy": "open"}, "policy"),
        ({"name": "../x"}, "tenant"),
        ({}, "name"),
        ({"name": "y", "extra": 1}, "extra"),
    ):
        async with api.session.post(api.url("/v1/admin/tenants"), json=bad, headers=adm) as r:
            assert r.status == 400 and field in (await r.json())["error"]["message"]
    async with api.session.get(api.url("/v1/admin/tenants"), headers=adm) as r:
        listed = (await r.json())["tenants"]
    assert [t["name"] for t in listed] == ["d"] and "keys" not in listed[0] and "token_hashes" not in listed[0]
    async with api.session.get(api.url("/v1/admin/tenants/d"), headers=adm) as r:
        assert r.status == 200 and (await r.json())["blocks"] == 0
    await api.tenant("s")
    async with api.session.post(api.url("/v1/admin/tenants/s/rotate-key"), headers=adm) as r:
        assert (await r.json())["key_version"] == 2
    async with api.session.post(api.url("/v1/admin/flush"), headers=adm) as r:
        assert r.status == 200
    async with api.session.post(api.url("/v1/admin/verify?deep=true"), headers=adm) as r:
        assert (await r.json())["ok"] is True
    async with api.session.delete(api.url("/v1/admin/tenants/nobody"), headers=adm) as r:
        assert r.status == 404


async def test_master_key_rotation(api: Api, tmp_path: object) -> None:
    h = api.auth(await api.tenant("alice"))
    await api.session.put(api.url("/v1/blocks/k"), data=b"v" * 1000, headers=h)
    new_key = Path(str(tmp_path)) / "new.key"
    new_key.write_bytes(os.urandom(32))
    new_key.chmod(0o600)
    async with api.session.post(
        api.url("/v1/admin/master-key"), json={"key_file": str(new_key)}, headers=api.auth(ADMIN)
    ) as r:
        assert r.status == 200 and len((await r.json())["master_key_id"]) == 16
    async with api.session.get(api.url("/v1/blocks/k"), headers=h) as r:
        assert await r.read() == b"v" * 1000
    new_key.chmod(0o644)
    async with api.session.post(
        api.url("/v1/admin/master-key"), json={"key_file": str(new_key)}, headers=api.auth(ADMIN)
    ) as r:
        assert r.status == 400
        assert "chmod 600" in (await r.json())["error"]["message"]


async def test_concurrent_clients(api: Api) -> None:
    h = api.auth(await api.tenant("alice"))

    async def one(i: int) -> None:
        data = KV[i:] + KV[:i]
        async with api.session.put(api.url(f"/v1/blocks/p{i}"), data=data, headers=h) as r:
            assert r.status == 201
        async with api.session.get(api.url(f"/v1/blocks/p{i}"), headers=h) as r:
            assert await r.read() == data

    await asyncio.gather(*(one(i) for i in range(24)))


async def test_unknown_route_and_method(api: Api) -> None:
    async with api.session.get(api.url("/v2/nothing")) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
    async with api.session.patch(api.url("/v1/blocks/k")) as r:
        assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"


async def test_client_can_close_mid_batch_get(api: Api) -> None:
    h = api.auth(await api.tenant("alice"))
    await api.session.post(
        api.url("/v1/batch/put"),
        data=io.BytesIO(batchframe.encode_put_stream([(f"k{i}", KV) for i in range(30)])),
        headers=h,
    )
    async with api.session.post(api.url("/v1/batch/get"), json={"keys": [f"k{i}" for i in range(30)]}, headers=h) as r:
        await r.content.readexactly(1000)
        r.close()
    async with api.session.get(api.url("/v1/blocks/k3"), headers=h) as r:
        assert r.status == 200 and await r.read() == KV
    _ = aiohttp  # the client library the test speaks through


async def test_corrupt_direct_block_is_a_500_never_wrong_bytes(api: Api) -> None:
    h = api.auth(await api.tenant("d", "direct"))
    async with api.session.put(api.url("/v1/blocks/x"), data=KV, headers=h) as r:
        assert r.status == 201
    seg = next((api.config.store.data_dir / "segments" / "d").glob("*.seg"))
    at = seg.read_bytes().index(KV[:64]) + 5000
    with seg.open("r+b") as f:
        f.seek(at)
        f.write(b"\x00" if KV[5000] else b"\x01")
    async with api.session.get(api.url("/v1/blocks/x"), headers=h) as r:
        assert r.status == 500 and (await r.json())["error"]["code"] == "corruption"
    async with api.session.post(api.url("/v1/batch/get"), json={"keys": ["x"]}, headers=h) as r:
        got = [item async for item in batchframe.read_get_items(r.content)]
    assert [(k, s) for k, s, _ in got] == [("x", 500)]

"""Membership on a real etcd (kvstore/fleet/etcd.py): leases instead of
heartbeat objects, behind the same interface as the bucket's. Joins, a node
whose lease expires declared dead once and back as a new incarnation, a
second process with the same id, racing joins, decommission; then three
daemons whose membership is on etcd: a killed node's blocks served by the
survivors, a node cut from etcd fencing itself and rejoining."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import boto3
import pytest

from kvstore.errors import NodeAlive, TierError
from kvstore.fleet.etcd import Etcd, EtcdMembership
from kvstore.fleet.membership import Superseded
from kvstore.fleet.view import FleetView

from ..moto_s3 import REGION, S3Env
from .etcd_server import EtcdServer
from .proxy import CuttableProxy
from .test_daemons import DEAD_AFTER_S, Fleet, call, until

DEAD_AFTER = 2.0  # a lease of 2 s


def members(view: FleetView) -> list[tuple[str, str, int]]:
    return [(m.id, m.state, m.incarnation) for m in view.members]


async def eventually(what: str, check: object, timeout: float) -> None:
    t0 = time.monotonic()
    while not await check():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.1)


async def test_leases_deaths_and_a_node_that_comes_back(etcd: EtcdServer, tmp_path: Path) -> None:
    kv = Etcd(etcd.url, f"/kvstore/{tmp_path.name}/", timeout_s=2)
    try:
        a, b, c = (EtcdMembership(kv, n, f"http://127.0.0.1:900{i}", DEAD_AFTER) for i, n in enumerate("abc"))
        for m in (a, b, c):
            assert await m.join() == 1
        view = await a.observe()
        assert view.version == 3 and members(view) == [("a", "alive", 1), ("b", "alive", 1), ("c", "alive", 1)]
        # b stops renewing its lease; a and c go on. etcd expires b's lease and a declares b dead, once.
        t0 = time.monotonic()

        async def b_dead() -> bool:
            await a.heartbeat()
            await c.heartbeat()
            views = [await a.observe(), await c.observe()]
            return all(v.member("b").state == "dead" for v in views)  # type: ignore[union-attr]

        await eventually("b declared dead", b_dead, 4 * DEAD_AFTER)
        assert time.monotonic() - t0 >= DEAD_AFTER - 0.5
        view = await c.observe()
        assert view.version == 4 and members(view) == [("a", "alive", 1), ("b", "dead", 1), ("c", "alive", 1)]
        # b comes back: a new lease, then, seeing itself dead, a new incarnation.
        await b.heartbeat()
        view = await b.observe()
        assert b.incarnation == 2 and ("b", "alive", 2) in members(view)
        assert ("b", "alive", 2) in members(await a.observe())
        # Decommission: refused while alive, done once dead.
        with pytest.raises(NodeAlive):
            await a.remove("b")
        assert not await a.remove("nobody")
    finally:
        await kv.close()


async def test_a_second_process_with_the_same_id_supersedes_the_first(etcd: EtcdServer, tmp_path: Path) -> None:
    kv = Etcd(etcd.url, f"/kvstore/{tmp_path.name}/", timeout_s=2)
    try:
        first = EtcdMembership(kv, "a", "http://127.0.0.1:9001", DEAD_AFTER)
        assert await first.join() == 1
        second = EtcdMembership(kv, "a", "http://127.0.0.1:9002", DEAD_AFTER)
        assert await second.join() == 2  # a restart: the kept incarnation + 1
        with pytest.raises(Superseded):
            await first.heartbeat()
        with pytest.raises(Superseded):
            await first.observe()
        await second.heartbeat()
        view = await second.observe()
        assert members(view) == [("a", "alive", 2)] and view.members[0].url == "http://127.0.0.1:9002"
    finally:
        await kv.close()


async def test_racing_joins_all_land(etcd: EtcdServer, tmp_path: Path) -> None:
    kv = Etcd(etcd.url, f"/kvstore/{tmp_path.name}/", timeout_s=5)
    try:
        nodes = [EtcdMembership(kv, f"n{i}", f"http://127.0.0.1:{9100 + i}", DEAD_AFTER) for i in range(8)]
        assert await asyncio.gather(*(m.join() for m in nodes)) == [1] * 8
        view = await nodes[0].observe()
        assert view.version == 8 and [m.id for m in view.alive()] == [f"n{i}" for i in range(8)]
    finally:
        await kv.close()


async def test_an_unreachable_etcd_is_a_tier_error() -> None:
    kv = Etcd("http://127.0.0.1:9", "/kvstore/x/", timeout_s=1)  # the discard port: refused
    try:
        with pytest.raises(TierError, match=re.escape("etcd at http://127.0.0.1:9")):
            await EtcdMembership(kv, "a", "http://127.0.0.1:9001", DEAD_AFTER).join()
    finally:
        await kv.close()


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (200, b'{"kvs": [{"value": "not base64!"}]}', "an unexpected answer"),
        (200, b'{"kvs": [{"mod_revision": "3", "value": "e30="}]}', None),  # fine: {} at revision 3
        (200, b"[1, 2]", "HTTP 200"),
        (500, b'{"error": "etcdserver: too many requests", "code": 14}', "too many requests"),
    ],
)
async def test_a_wrong_answer_from_etcd_is_a_tier_error(status: int, body: bytes, says: str | None) -> None:
    """Faults injected by a stand-in that answers every call with ``body``:
    whatever etcd (or a proxy before it) answers, the fleet's loop sees a
    TierError it logs and retries, never another exception that would end it."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v3/{path:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    kv = Etcd(f"http://127.0.0.1:{port}", "/kvstore/x/", timeout_s=2)
    try:
        if says is None:
            assert await kv.get("k") == (b"{}", "3")
        else:
            with pytest.raises(TierError, match=re.escape(says)):
                await kv.get("k")
    finally:
        await kv.close()
        await runner.cleanup()


async def test_three_daemons_with_membership_on_etcd(etcd: EtcdServer, tmp_path: Path, s3: S3Env) -> None:
    """The fleet's behaviour with etcd in place of the bucket's membership:
    a killed node is declared dead when its lease expires and the survivors
    serve its flushed blocks; it restarts as incarnation 2; a node cut from
    etcd refuses writes by itself and rejoins when it can reach etcd again.
    No heartbeat object is written to the bucket."""
    from kvstore_client import AsyncClient
    from kvstore_client.sharding import rank_endpoints

    fleet = Fleet(tmp_path, s3, 3)
    proxies = [CuttableProxy(etcd.port) for _ in fleet.nodes]
    for d, p in zip(fleet.nodes, proxies, strict=True):
        d.env["KVSTORE_FLEET_ETCD_URL"] = p.url
    try:
        fleet.start()
        n0, n1, n2 = fleet.nodes
        made = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "t", "policy": "sealed"})
        token = made.body["token"]
        fleet.wait_token(token)
        urls = sorted(d.base for d in fleet.nodes)
        blocks = {f"blk-{i:03d}": os.urandom(2000 + i) for i in range(30)}
        async with AsyncClient(n0.base, token, fleet=True, fleet_refresh_s=0.5, timeout=5, retries=1) as kv:
            assert all(await kv.put_many(blocks.items()))
            for d in fleet.nodes:
                assert call(d.base, "POST", "/v1/admin/flush").status == 200
            theirs = [k for k in blocks if rank_endpoints(urls, k)[0] == n1.base]
            assert theirs
            n1.stop(signal.SIGKILL)
            took = until(
                "node-1 declared dead", lambda: fleet.member(n0, "node-1")["state"] == "dead", 4 * DEAD_AFTER_S
            )
            assert took >= DEAD_AFTER_S - 1, f"declared dead after {took:.1f} s"
            t0 = time.monotonic()
            while await kv.get_many(theirs) != [blocks[k] for k in theirs]:
                assert time.monotonic() - t0 < 20, "the survivors did not serve node-1's blocks"
                await asyncio.sleep(0.2)
            assert await kv.lookup_detail(theirs) == [True] * len(theirs)
            n1.start()
            until("node-1 back", lambda: fleet.member(n0, "node-1")["state"] == "alive", 20)
            assert fleet.member(n0, "node-1")["incarnation"] == 2
        # Cut from etcd (the bucket still reachable): fenced by itself, declared dead, back when healed.
        proxies[2].cut()
        keys = iter(range(10**6))
        until(
            "node-2 fences itself",
            lambda: call(n2.base, "PUT", f"/v1/blocks/cut{next(keys)}", token, data=b"y" * 100).status == 503,
            DEAD_AFTER_S + 2,
        )
        assert call(n2.base, "GET", "/readyz").body["error"]["code"] == "fenced"
        until("node-2 declared dead", lambda: fleet.member(n0, "node-2")["state"] == "dead", 4 * DEAD_AFTER_S)
        proxies[2].heal()
        until(
            "node-2 writes again",
            lambda: call(n2.base, "PUT", f"/v1/blocks/healed{next(keys)}", token, data=b"z" * 100).status == 201,
            4 * DEAD_AFTER_S,
        )
        until("node-2 alive again", lambda: fleet.member(n0, "node-2")["state"] == "alive", 4 * DEAD_AFTER_S)
        assert fleet.member(n0, "node-2")["incarnation"] == 2
        s3c = boto3.client("s3", endpoint_url=s3.url, region_name=REGION)
        listed = s3c.list_objects_v2(Bucket=s3.bucket, Prefix=fleet.prefix).get("Contents", [])
        names = [o["Key"] for o in listed]
        assert not [n for n in names if n.endswith("heartbeat.json") or n.endswith("members.json")], names
    finally:
        fleet.stop()
        for p in proxies:
            p.close()

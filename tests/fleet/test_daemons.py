"""Three daemons on 127.0.0.1 with one S3 endpoint (moto's server) as a
fleet: they join, a node killed with SIGKILL is declared dead and comes back
as a new incarnation, a node cut from the bucket refuses writes by itself
and rejoins when it can reach it again, a node stopped with SIGSTOP rejoins
after SIGCONT, and tenants are the fleet's: created, changed and revoked on
any node, on every node within one refresh, racing admin calls all landing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvstore_client.nixl import nixl_available
from kvstore_client.sharding import normalize, rank_endpoints

from kvstore.fleet.shared import READ_EVERY_S

from ..http.conftest import ADMIN, ROOT, Daemon, daemon_env, free_port
from ..http.rawhttp import worker_connections
from ..moto_s3 import AWS_ENV, REGION, S3Env
from .proxy import CuttableProxy

HEARTBEAT_S = 0.5
DEAD_AFTER_S = 2.5
REFRESH_S = 1
HANDBACK_S = 3  # survivors serve a returned node's blocks beside it this long (clients here refresh every 0.5 s)
WORKERS = int(os.environ.get("FLEET_TEST_WORKERS", "2"))  # per node: the writer and readers that follow it


@dataclass
class Reply:
    status: int
    body: Any


def call(base: str, method: str, path: str, token: str = ADMIN, doc: Any = None, data: bytes | None = None) -> Reply:
    body = json.dumps(doc).encode() if doc is not None else data
    req = urllib.request.Request(base + path, data=body, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    if doc is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return Reply(status, json.loads(raw) if raw else None)
    except ValueError:
        return Reply(status, raw)


def until(what: str, check: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``check()`` holds (fails the test after ``timeout``)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


class Fleet:
    def __init__(self, tmp: Path, s3: S3Env, n: int, sock_dir: Path | None = None, **settings: str) -> None:
        """``sock_dir``: each node also listens on ``sock_dir/nN.sock``;
        ``settings``: more KVSTORE_* settings of every node."""
        key = tmp / "master.key"  # every node of a fleet has the same master key
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        self.prefix = f"fleet-{uuid.uuid4().hex[:8]}"
        self.s3 = s3
        self.nodes: list[Daemon] = []
        self.proxies: list[CuttableProxy] = []
        for i in range(n):
            proxy = CuttableProxy(s3.endpoint.port)
            self.proxies.append(proxy)
            port = free_port()
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "PYTHONPATH": str(ROOT),
                "KVSTORE_ADMIN_TOKEN": ADMIN,
                "KVSTORE_MASTER_KEY_FILE": str(key),
                "KVSTORE_WORKERS": str(WORKERS),
                "KVSTORE_SEGMENT_SIZE": "1MiB",
                "KVSTORE_S3_ENDPOINT": proxy.url,
                "KVSTORE_S3_BUCKET": s3.bucket,
                "KVSTORE_S3_PREFIX": self.prefix,
                "KVSTORE_S3_REFRESH_S": str(REFRESH_S),
                "KVSTORE_FLEET": "1",
                "KVSTORE_NODE_ID": f"node-{i}",
                "KVSTORE_ADVERTISE_URL": f"http://127.0.0.1:{port}",
                "KVSTORE_FLEET_HEARTBEAT_S": str(HEARTBEAT_S),
                "KVSTORE_FLEET_DEAD_AFTER_S": str(DEAD_AFTER_S),
                "KVSTORE_FLEET_HANDBACK_S": str(HANDBACK_S),
                **AWS_ENV,
                **{"KVSTORE_" + k.upper(): v for k, v in settings.items()},
            }
            (tmp / f"n{i}").mkdir()
            d = Daemon(tmp / f"n{i}" / "data", port, env, own_group=True)  # SIGKILL/SIGSTOP: every worker
            if sock_dir is not None:
                d.extra = ["--listen", f"unix:{sock_dir / f'n{i}.sock'}", "--unix-socket-mode", "0666"]
            self.nodes.append(d)

    def start(self) -> None:
        for d in self.nodes:
            d.start()
        for d in self.nodes:
            until(f"{d.base} ready", lambda d=d: call(d.base, "GET", "/readyz").status == 200, 20)  # type: ignore[misc]
        until(
            "every node sees every node alive",
            lambda: all(len(self.alive(d)) == len(self.nodes) for d in self.nodes),
            20,
        )

    def key_on(self, d: Daemon, tag: str) -> str:
        """A key the fleet places on ``d`` while every node is alive: a node
        stores only its own keys (a write of another's is 421 misdirected)."""
        return next(self.keys_on(d, tag))

    def keys_on(self, d: Daemon, tag: str) -> Iterator[str]:
        """Keys ``tag-N`` the fleet places on ``d`` while every node is alive, each once."""
        urls = sorted(normalize(n.env["KVSTORE_ADVERTISE_URL"]) for n in self.nodes)
        mine = normalize(d.env["KVSTORE_ADVERTISE_URL"])
        return (k for i in range(10**7) if rank_endpoints(urls, k := f"{tag}-{i}")[0] == mine)

    def wait_token(self, token: str) -> None:
        """Until every node knows the tenant ``token`` names (within a refresh of the fleet's registry)."""
        for d in self.nodes:
            if d.proc is not None:
                ok = lambda d=d: call(d.base, "GET", "/v1/stats", token).status == 200  # noqa: E731
                until(f"the token on {d.base}", ok, REFRESH_S + 3)

    def view(self, d: Daemon) -> dict[str, Any]:
        r = call(d.base, "GET", "/v1/fleet")
        assert r.status == 200, r
        assert isinstance(r.body, dict)
        return r.body

    def alive(self, d: Daemon) -> list[str]:
        return [n["id"] for n in self.view(d)["nodes"] if n["state"] == "alive"]

    def member(self, d: Daemon, node_id: str) -> dict[str, Any]:
        return next(n for n in self.view(d)["nodes"] if n["id"] == node_id)

    def stop(self) -> None:
        for d in self.nodes:
            if d.proc is not None:
                d.signal_all(signal.SIGCONT)
                d.stop(signal.SIGKILL)
        for p in self.proxies:
            p.close()


@pytest.fixture
def fleet(tmp_path: Path, s3: S3Env) -> Iterator[Fleet]:
    f = Fleet(tmp_path, s3, 3)
    try:
        f.start()  # (inside: nodes that started are stopped when another does not)
        yield f
    finally:
        f.stop()


def test_nodes_join_a_killed_node_is_declared_dead_and_comes_back(fleet: Fleet) -> None:
    n0, n1, _ = fleet.nodes
    view = fleet.view(n0)
    assert view["version"] >= 3
    assert {(m["id"], m["state"], m["incarnation"], m["url"]) for m in view["nodes"]} == {
        (f"node-{i}", "alive", 1, d.base) for i, d in enumerate(fleet.nodes)
    }
    assert all(fleet.view(d)["version"] == view["version"] for d in fleet.nodes)
    n1.stop(signal.SIGKILL)
    took = until("node-1 declared dead", lambda: fleet.member(n0, "node-1")["state"] == "dead", 4 * DEAD_AFTER_S)
    assert took >= DEAD_AFTER_S - 2 * HEARTBEAT_S, f"declared dead after {took:.1f} s"
    assert sorted(fleet.alive(n0)) == ["node-0", "node-2"]
    n1.start()
    until("node-1 back", lambda: fleet.member(n0, "node-1")["state"] == "alive", 20)
    assert fleet.member(n0, "node-1")["incarnation"] == 2  # a restarted node is a new incarnation of its id
    assert (n1.data_dir / "node-id").read_text().strip() == "node-1"


def test_a_node_cut_from_the_bucket_refuses_writes_by_itself_and_rejoins(fleet: Fleet) -> None:
    n0, _, n2 = fleet.nodes
    t = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "w", "policy": "direct"})
    assert t.status == 201, t
    token = t.body["token"]
    until("the tenant on node-2", lambda: call(n2.base, "GET", "/v1/stats", token).status == 200, 3 * REFRESH_S + 2)
    before = fleet.key_on(n2, "before")  # node-2's own keys: a node stores only those
    assert call(n2.base, "PUT", f"/v1/blocks/{before}", token, data=b"x" * 1000).status == 201
    fleet.proxies[2].cut()
    keys = fleet.keys_on(n2, "w")  # a new key each time: a PUT of a key already stored writes nothing
    until(
        "node-2 fences itself",
        lambda: call(n2.base, "PUT", f"/v1/blocks/{next(keys)}", token, data=b"y" * 1000).status == 503,
        DEAD_AFTER_S + 2,
    )
    r = call(n2.base, "PUT", f"/v1/blocks/{next(keys)}", token, data=b"y" * 1000)
    assert r.status == 503 and r.body["error"]["code"] == "fenced", r
    # (that PUT may have met the tenant fence, which can come up to a heartbeat before the write fence)
    until("node-2 not ready", lambda: call(n2.base, "GET", "/readyz").status == 503, 2)
    # Every worker says so (a reader from its writer's published state, within half a heartbeat).
    until(
        "every worker of node-2 not ready",
        lambda: all(call(n2.base, "GET", "/readyz").status == 503 for _ in range(10)),
        3,
    )
    ready = call(n2.base, "GET", "/readyz")
    assert ready.status == 503 and ready.body["error"]["code"] == "fenced", ready
    # Reads stop too, once it cannot confirm the fleet's tenant registry either (issue 40: a stale
    # registry might pass a token revoked elsewhere; tests/fleet/test_tenant_propagation.py).
    until("node-2 refuses its tenant", lambda: call(n2.base, "GET", f"/v1/blocks/{before}", token).status == 503, 5)
    until("node-2 declared dead", lambda: fleet.member(n0, "node-2")["state"] == "dead", 4 * DEAD_AFTER_S)
    fleet.proxies[2].heal()
    until(
        "node-2 writes again",
        lambda: call(n2.base, "PUT", f"/v1/blocks/{next(keys)}", token, data=b"z" * 1000).status == 201,
        4 * DEAD_AFTER_S,
    )
    until(
        "every worker of node-2 ready", lambda: all(call(n2.base, "GET", "/readyz").status == 200 for _ in range(10)), 3
    )
    until("node-2 alive again", lambda: fleet.member(n0, "node-2")["state"] == "alive", 4 * DEAD_AFTER_S)
    assert fleet.member(n0, "node-2")["incarnation"] == 2


def test_a_stopped_node_rejoins_after_sigcont(fleet: Fleet) -> None:
    n0, n1, _ = fleet.nodes
    assert n1.proc is not None
    n1.signal_all(signal.SIGSTOP)  # every worker: the node, frozen
    try:
        until("node-1 declared dead", lambda: fleet.member(n0, "node-1")["state"] == "dead", 4 * DEAD_AFTER_S)
    finally:
        n1.signal_all(signal.SIGCONT)
    until("node-1 alive again", lambda: fleet.member(n0, "node-1")["state"] == "alive", 4 * DEAD_AFTER_S)
    assert fleet.member(n0, "node-1")["incarnation"] == 2
    assert call(n1.base, "GET", "/readyz").status == 200
    log = n1.log.read_text()
    assert "refusing writes until it has rejoined the fleet" in log and "is back in the fleet" in log


def test_tenants_are_the_fleets(fleet: Fleet) -> None:
    n0, n1, n2 = fleet.nodes
    made = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "shared", "policy": "sealed"})
    assert made.status == 201, made
    token = made.body["token"]
    fleet.wait_token(token)
    # Admin calls racing on two nodes: every one lands.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [
            pool.submit(
                call, (n0, n1)[i % 2].base, "POST", "/v1/admin/tenants", ADMIN, {"name": f"r{i}", "policy": "direct"}
            )
            for i in range(8)
        ]
        replies = [f.result() for f in futs]
    assert [r.status for r in replies] == [201] * 8, replies
    for d in fleet.nodes:
        until(
            f"every tenant on {d.base}",
            lambda d=d: (
                {t["name"] for t in call(d.base, "GET", "/v1/admin/tenants").body["tenants"]}  # type: ignore[misc]
                >= {"shared", *(f"r{i}" for i in range(8))}
            ),
            REFRESH_S + 3,
        )
    # A block written through node-0 (sealed) is read back there; the token is revoked on node-2:
    # every node refuses it within one refresh.
    assert call(n0.base, "PUT", f"/v1/blocks/{fleet.key_on(n0, 'k')}", token, data=b"sealed" * 100).status == 201
    tokens = call(n2.base, "GET", "/v1/admin/tenants/shared").body["tokens"]
    assert call(n2.base, "DELETE", f"/v1/admin/tenants/shared/tokens/{tokens[0]['id']}").status == 204
    for d in fleet.nodes:
        took = until(
            f"revoked on {d.base}", lambda d=d: call(d.base, "GET", "/v1/stats", token).status == 401, REFRESH_S + 3
        )  # type: ignore[misc]
        assert took <= REFRESH_S + 3
    # Deleted on node-1: gone everywhere.
    assert call(n1.base, "DELETE", "/v1/admin/tenants/r0").status == 204
    for d in fleet.nodes:
        until(
            f"r0 gone on {d.base}", lambda d=d: call(d.base, "GET", "/v1/admin/tenants/r0").status == 404, REFRESH_S + 3
        )  # type: ignore[misc]


def test_the_fleet_route(fleet: Fleet, tmp_path: Path) -> None:
    n0 = fleet.nodes[0]
    assert call(n0.base, "GET", "/v1/fleet", token="kvs_nobody").status == 401
    t = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "reader", "policy": "direct"})
    assert call(n0.base, "GET", "/v1/fleet", token=t.body["token"]).status == 200  # any tenant's token
    (tmp_path / "alone").mkdir()
    alone = Daemon(tmp_path / "alone" / "data", free_port(), daemon_env(tmp_path / "alone"))  # not in a fleet
    alone.start()
    try:
        r = call(alone.base, "GET", "/v1/fleet")
        assert r.status == 404 and r.body["error"]["code"] == "fleet_off", r
    finally:
        alone.stop()


async def test_a_fleet_client_finds_the_members_and_places_keys_as_the_daemons(fleet: Fleet) -> None:
    """``AsyncClient(seed, token, fleet=True)``: one seed, every member
    learned from ``GET /v1/fleet``; each key lands on the node the fleet's
    rendezvous hashing names; a node killed leaves the client's placement
    once the fleet declares it dead, and new keys go to the survivors."""
    from kvstore_client import AsyncClient
    from kvstore_client.sharding import rank_endpoints

    n0, n1, _ = fleet.nodes
    made = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "c", "policy": "direct"})
    token = made.body["token"]
    fleet.wait_token(token)
    urls = sorted(d.base for d in fleet.nodes)
    async with AsyncClient(n0.base, token, fleet=True, fleet_refresh_s=0.5, timeout=2, retries=0) as kv:
        assert await kv.put("first", b"0" * 100)
        assert kv.endpoints == urls and kv.fleet_version == fleet.view(n0)["version"]
        keys = [f"key-{i}" for i in range(30)]
        assert all(await kv.put_many((k, k.encode() * 50) for k in keys))
        for k in keys:
            owner = rank_endpoints(urls, k)[0]
            for d in fleet.nodes:
                want = 200 if d.base == owner else 404
                assert call(d.base, "GET", f"/v1/blocks/{k}", token).status == want, (k, d.base)
        n1.stop(signal.SIGKILL)
        until("node-1 declared dead", lambda: fleet.member(n0, "node-1")["state"] == "dead", 4 * DEAD_AFTER_S)
        survivors = sorted(d.base for d in fleet.nodes if d is not n1)
        t0 = time.monotonic()
        while kv.endpoints != survivors:
            assert time.monotonic() - t0 < 10, kv.endpoints
            await kv.exists("anything")  # every call reads the membership when due
            await asyncio.sleep(0.1)
        later = [f"later-{i}" for i in range(20)]
        assert all(await kv.put_many((k, b"x" * 10) for k in later))  # none is placed on the dead node


def _takeover_events(base: str, token: str, timeout: float = 10.0) -> set[str]:
    """The keys of the ``stored`` events with cause ``takeover`` a node's
    event stream (``GET /v1/events?since=0``, never ending) has told, read
    until one such event has come and the stream is quiet for a moment."""
    req = urllib.request.Request(base + "/v1/events?since=0", headers={"Authorization": f"Bearer {token}"})
    keys: set[str] = set()
    deadline = time.monotonic() + timeout
    with urllib.request.urlopen(req, timeout=1.0) as r:
        while time.monotonic() < deadline:
            try:
                line = r.readline()
            except TimeoutError:
                if keys:
                    break
                continue
            if line.startswith(b"data: "):
                ev = json.loads(line[6:])
                if ev.get("cause") == "takeover" and ev.get("kind") == "stored":
                    keys |= {b["key"] for b in ev["blocks"]}
    return keys


async def test_survivors_serve_a_dead_nodes_flushed_blocks_and_let_go_when_it_returns(fleet: Fleet) -> None:
    """Blocks written through a fleet client and flushed to the bucket; the
    node holding a third of them killed with SIGKILL. Once the fleet has
    declared it dead, every one of its blocks is read back byte-exact
    through the client from the survivors (single reads, batch reads) and
    lookups find them; when it restarts, the survivors let go and the fleet
    is back to the first placement."""
    from kvstore_client import AsyncClient
    from kvstore_client.sharding import rank_endpoints

    n0, n1, n2 = fleet.nodes
    made = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "t", "policy": "sealed"})
    token = made.body["token"]
    fleet.wait_token(token)
    urls = sorted(d.base for d in fleet.nodes)
    blocks = {f"blk-{i:03d}": os.urandom(3000 + i) for i in range(60)}
    async with AsyncClient(n0.base, token, fleet=True, fleet_refresh_s=0.5, timeout=5, retries=1) as kv:
        assert all(await kv.put_many(blocks.items()))
        for d in fleet.nodes:
            r = call(d.base, "POST", "/v1/admin/flush")
            assert r.status == 200 and r.body["tier"] == "mirrored", r
        theirs = [k for k in blocks if rank_endpoints(urls, k)[0] == n1.base]
        assert len(theirs) >= 5
        n1.stop(signal.SIGKILL)
        until("node-1 declared dead", lambda: fleet.member(n0, "node-1")["state"] == "dead", 4 * DEAD_AFTER_S)
        t0 = time.monotonic()
        while kv.endpoints != sorted([n0.base, n2.base]):
            assert time.monotonic() - t0 < 10
            await kv.exists("probe")
            await asyncio.sleep(0.1)

        async def all_back() -> bool:
            got = await kv.get_many(theirs)
            return got == [blocks[k] for k in theirs]

        t0 = time.monotonic()
        while not await all_back():
            assert time.monotonic() - t0 < 20, "the survivors did not serve node-1's blocks"
            await asyncio.sleep(0.2)
        for k in theirs:
            assert await kv.get(k) == blocks[k]
        # Every worker of a survivor answers them: the reader relays them to its
        # writer, the only one that holds node-1's blocks (kvstore/fleet/shared.py).
        for d in (n0, n2) if WORKERS > 1 else ():
            ours = [k for k in theirs if rank_endpoints(sorted([n0.base, n2.base]), k)[0] == d.base]
            assert ours
            conns = await worker_connections("127.0.0.1", d.port)
            try:
                for role, conn in conns.items():
                    # A reader sees its writer's adoption within READ_EVERY_S of its publication
                    # (at once, kvstore/fleet/shared.py): the writer may have served it a moment sooner.
                    t0 = time.monotonic()
                    auth = {"Authorization": f"Bearer {token}"}
                    while (await conn.request("GET", f"/v1/blocks/{ours[0]}", auth)).status == 404:
                        assert time.monotonic() - t0 < 2 * READ_EVERY_S + 1, (role, "the adoption never reached it")
                        await asyncio.sleep(READ_EVERY_S / 4)
                    for k in ours:
                        r = await conn.request("GET", f"/v1/blocks/{k}", {"Authorization": f"Bearer {token}"})
                        assert (r.status, r.body == blocks[k]) == (200, True), (role, k)
                        doc = json.dumps({"keys": [k]}).encode()
                        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
                        r = await conn.request("POST", "/v1/lookup", headers, doc)
                        assert r.json()["present"] == [True], (role, k)
            finally:
                for conn in conns.values():
                    await conn.close()
        assert await kv.lookup_detail(theirs) == [True] * len(theirs)
        assert await kv.lookup([*theirs, "never-written"]) == len(theirs)
        present, locks = await kv.lookup_and_lock(theirs, lease_s=30)  # LMCache MP's lookups
        assert present == [True] * len(theirs)
        assert not (await kv.release_locks(locks)).leases
        survivor_logs = n0.log.read_text() + n2.log.read_text()
        assert survivor_logs.count("took over node node-1's blocks") == 2
        # Residency events: each survivor tells the adopted blocks placed on it (cause "takeover").
        told: set[str] = set()
        for d in (n0, n2):
            told |= _takeover_events(d.base, token)
        assert told == set(theirs)
        n1.start()
        until("node-1 alive again", lambda: fleet.member(n0, "node-1")["state"] == "alive", 20)
        t0 = time.monotonic()
        while kv.endpoints != urls:
            assert time.monotonic() - t0 < 10
            await kv.exists("probe")
            await asyncio.sleep(0.1)
        until(
            "the survivors let go", lambda: (n0.log.read_text() + n2.log.read_text()).count("node-1 is back") == 2, 10
        )
        assert await kv.get_many(list(blocks)) == list(blocks.values())  # the first placement, node-1's own data


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (tests/run.sh installs it)")
async def test_takeover_serves_read_plans_and_nixl_reads(
    tmp_path: Path, s3: S3Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead node's blocks through the two transports that do not go by
    HTTP: a client on a survivor's unix socket (read plans: the survivor
    answers them not plannable, and the client GETs them on the socket) and
    a NIXL client (the survivor stages them from the bucket)."""
    from kvstore_client import AsyncClient
    from kvstore_client.sharding import rank_endpoints

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "tcp")
    sock_dir = Path(tempfile.mkdtemp(prefix="kvs-fleet-"))  # short: a socket's path has at most 108 bytes
    f = Fleet(tmp_path, s3, 3, sock_dir, nixl="1", nixl_devices="lo")
    for d in f.nodes:
        d.env["UCX_TLS"] = "tcp"
    try:
        f.start()
        n0, n1, n2 = f.nodes
        token = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "d", "policy": "direct"}).body["token"]
        f.wait_token(token)
        urls = sorted(d.base for d in f.nodes)
        blocks = {f"k{i:03d}": os.urandom(20_000 + i) for i in range(60)}
        async with AsyncClient(n0.base, token, fleet=True, timeout=5) as kv:
            assert all(await kv.put_many(blocks.items()))
        for d in f.nodes:
            assert call(d.base, "POST", "/v1/admin/flush").body["tier"] == "mirrored"
        n1.stop(signal.SIGKILL)
        until("node-1 declared dead", lambda: f.member(n0, "node-1")["state"] == "dead", 4 * DEAD_AFTER_S)
        alive = sorted([n0.base, n2.base])
        theirs = [k for k in blocks if rank_endpoints(urls, k)[0] == n1.base]
        on_n0 = [k for k in theirs if rank_endpoints(alive, k)[0] == n0.base]
        assert on_n0
        async with AsyncClient(f"unix:{sock_dir / 'n0.sock'}", token, timeout=5) as unix:
            t0 = time.monotonic()
            while await unix.get_many_into(on_n0, [bytearray(len(blocks[k])) for k in on_n0]) != [
                len(blocks[k]) for k in on_n0
            ]:
                assert time.monotonic() - t0 < 20, "node-0 did not take over"
                await asyncio.sleep(0.2)
            bufs = [bytearray(len(blocks[k])) for k in on_n0]
            assert await unix.get_many_into(on_n0, bufs) == [len(blocks[k]) for k in on_n0]
            assert [bytes(b) for b in bufs] == [blocks[k] for k in on_n0]
            assert unix.stats["plan_fallbacks"] >= len(on_n0)  # planned not plannable, then read over the socket
        async with AsyncClient(n0.base, token, transport="nixl", timeout=10) as nixl:
            bufs = [bytearray(len(blocks[k])) for k in on_n0]
            assert await nixl.get_many_into(on_n0, bufs) == [len(blocks[k]) for k in on_n0]
            assert [bytes(b) for b in bufs] == [blocks[k] for k in on_n0]
            assert nixl.stats["nixl_reads"] >= len(on_n0) and nixl.stats["nixl_fallbacks"] == 0
    finally:
        f.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_dead_node_is_forgotten_for_good(fleet: Fleet) -> None:
    """``DELETE /v1/admin/fleet/nodes/{id}?purge=true``: a dead node out of
    the membership (every node's view, the survivors' takeover let go) and
    its part of the bucket deleted; an alive node is refused."""
    n0, n1, n2 = fleet.nodes
    token = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "g", "policy": "direct"}).body["token"]
    fleet.wait_token(token)
    for key in itertools.islice(fleet.keys_on(n1, "k"), 20):
        assert call(n1.base, "PUT", f"/v1/blocks/{key}", token, data=os.urandom(2000)).status == 201
    assert call(n1.base, "POST", "/v1/admin/flush").body["tier"] == "mirrored"
    r = call(n0.base, "DELETE", "/v1/admin/fleet/nodes/node-1")
    assert r.status == 409 and r.body["error"]["code"] == "node_alive", r
    n1.stop(signal.SIGKILL)
    until("node-1 declared dead", lambda: fleet.member(n0, "node-1")["state"] == "dead", 4 * DEAD_AFTER_S)
    until("node-2 took over", lambda: "took over node node-1" in n2.log.read_text(), 20)
    r = call(n0.base, "DELETE", "/v1/admin/fleet/nodes/node-1?purge=true")
    assert r.status == 200 and r.body["objects_deleted"] > 0, r
    for d in (n0, n2):
        until(f"node-1 gone on {d.base}", lambda d=d: "node-1" not in [m["id"] for m in fleet.view(d)["nodes"]], 5)
    until("node-2 let go", lambda: "node-1 was forgotten by the fleet" in n2.log.read_text(), 10)
    import boto3

    s3 = boto3.client("s3", endpoint_url=fleet.s3.url, region_name=REGION)
    left = s3.list_objects_v2(Bucket=fleet.s3.bucket, Prefix=f"{fleet.prefix}/nodes/node-1/").get("KeyCount", 0)
    assert left == 0
    assert call(n0.base, "DELETE", "/v1/admin/fleet/nodes/node-1").status == 404
    assert call(n0.base, "DELETE", "/v1/admin/fleet/nodes/node-0").status == 409  # this node
    assert call(n0.base, "DELETE", "/v1/admin/fleet/nodes/Bad_Id").status == 400

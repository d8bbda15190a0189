"""Read plans with paths (``plan_paths``): over any listener, a plan names
each block's segment file by its absolute path, for clients that mount the
data directory at the same path (here: the same host, the same files). The
bytes read from the path are the bytes GET gives; sealed blocks carry their
record's key only over TLS, unix or loopback; leases belong to the tenant,
released from any connection (and any worker) or by expiry, and keep their
segments through compaction until then."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvstore_client import AsyncClient
from kvstore_client.errors import CorruptBlock, KVStoreClientError, ServerError
from kvstore_client.plans import PlanConnection, parse_plan

from kvstore.daemon.app import make_app
from kvstore.engine.crypto import MasterKey
from kvstore.engine.lifecycle import Leases
from kvstore.transport.http.appkeys import STORE

from ..conftest import kv_sample
from .conftest import ROOT, Daemon, KVTestServer, free_port, server_config
from .openapi import Spec
from .test_read_plans import BLOCK, _blocks, _compact, _put, _tenant


@dataclass
class Server:
    base: str
    data_dir: Path
    server: KVTestServer


async def _serve(tmp_path: Path, host: str = "127.0.0.1", **flags: str) -> Server:
    cfg = server_config(tmp_path / "data", compact_interval_s="0", **flags)
    server = KVTestServer(make_app(cfg, MasterKey(os.urandom(32))), host=host, port=free_port())
    await server.start_server()
    return Server(f"http://127.0.0.1:{server.port}", cfg.store.data_dir, server)


@pytest.fixture
async def paths_on(tmp_path: Path) -> AsyncIterator[Server]:
    s = await _serve(tmp_path, plan_paths="true")
    yield s
    await s.server.close()


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _plan(
    s: aiohttp.ClientSession, base: str, token: str, keys: list[str], status: int = 200, **extra: Any
) -> dict[str, Any]:
    async with s.post(base + "/v1/read-plan", json={"keys": keys, "paths": True, **extra}, headers=_h(token)) as r:
        doc = await r.json()
        assert r.status == status, doc
        if status == 200:
            assert r.headers.get("Kvstore-Fds", "0") == "0"
            problems = Spec.load().problems("POST", "/v1/read-plan", 200, r.headers["Content-Type"], await r.read())
            assert problems == []
        return dict(doc)


async def _release(s: aiohttp.ClientSession, base: str, token: str, lease: str) -> int:
    async with s.delete(f"{base}/v1/read-plan/{lease}", headers=_h(token)) as r:
        body = await r.read()
        ct = r.headers.get("Content-Type", "")
        assert Spec.load().problems("DELETE", "/v1/read-plan/{lease}", r.status, ct, body) == []
        return r.status


async def _get(s: aiohttp.ClientSession, base: str, token: str, key: str) -> bytes:
    async with s.get(f"{base}/v1/blocks/{key}", headers=_h(token)) as r:
        assert r.status == 200
        return await r.read()


def _read(block: Any) -> bytes:
    buf = bytearray(block.size)
    assert PlanConnection.read_into(block, buf) == block.size
    return bytes(buf)


async def test_paths_are_refused_unless_offered(tmp_path: Path) -> None:
    """plan_paths off: 400 paths_not_offered, whatever the listener; a plan
    without paths over TCP is refused as before; the client falls back to
    GET and stops asking."""
    srv = await _serve(tmp_path)
    try:
        direct = _blocks("d", 2)
        async with aiohttp.ClientSession() as s:
            token = await _tenant(s, srv.base, "d", "direct")
            await _put(s, srv.base, token, direct)
            doc = await _plan(s, srv.base, token, ["d0"], status=400)
            assert doc["error"]["code"] == "paths_not_offered"
            assert "plan_paths" in doc["error"]["message"] and "same path" in doc["error"]["message"]
            body = json.dumps(doc).encode()
            assert Spec.load().problems("POST", "/v1/read-plan", 400, "application/json", body) == []
            async with s.post(srv.base + "/v1/read-plan", json={"keys": ["d0"]}, headers=_h(token)) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "unix_socket_required"
            async with s.post(srv.base + "/v1/read-plan", json={"keys": ["d0"], "paths": 1}, headers=_h(token)) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_input"
            async with s.delete(srv.base + "/v1/read-plan/" + "0" * 32, headers=_h(token)) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "unix_socket_required"
        async with AsyncClient(srv.base, token, plan_paths=True) as c:
            for k, v in direct.items():
                buf = bytearray(BLOCK + 10)
                assert await c.get_into(k, buf) == len(v) and buf[: len(v)] == v
            assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (0, 1)  # asked once, then not again
            with pytest.raises(ServerError) as e:
                await c.read_plan(["d0"], paths=True)
            assert e.value.code == "paths_not_offered"
            with pytest.raises(ValueError, match="unix:PATH"):
                await c.read_plan(["d0"])
    finally:
        await srv.server.close()


async def test_a_path_plan_reads_what_get_gives(paths_on: Server) -> None:
    base = paths_on.base
    direct = _blocks("d", 8) | {"small": b"tiny block", "frames": os.urandom(5 * 65536 + 17)}
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, base, "d", "direct")
        await _put(s, base, token, direct)
        doc = await _plan(s, base, token, [*direct, "missing", "bad/key"])
        assert doc["files"] == [] and doc["closed"] == []
        entries = {b["key"]: b for b in doc["blocks"]}
        seg_dir = os.path.abspath(paths_on.data_dir / "segments" / "d")
        for k in direct:
            assert "file" not in entries[k] and os.path.dirname(entries[k]["path"]) == seg_dir
        assert len(entries["frames"]["xxh3"]) == 6  # a block over several frames, each checked
        plan = parse_plan(doc, "", {})
        assert plan.others == {"missing": (404, "not_found"), "bad/key": (400, "invalid_key")}
        for k, v in direct.items():
            assert plan.blocks[k].fd == -1 and _read(plan.blocks[k]) == v == await _get(s, base, token, k)
        assert len({b.path for b in plan.blocks.values()}) >= 2  # the blocks span segments
        assert await _release(s, base, token, doc["lease"]) == 204
        assert await _release(s, base, token, doc["lease"]) == 404
        # Nothing of this tenant is leased any more.
        store = paths_on.server.app[STORE]
        assert not any(store.leases.held(("d", sid)) for sid in range(1, 6))


async def test_sealed_blocks_carry_records_over_loopback_only(tmp_path: Path) -> None:
    """Over loopback the client opens sealed blocks' frames itself; from a
    non-loopback address the daemon keeps the record's key: 403 for those
    blocks (direct ones are still planned), and the client GETs them."""
    srv = await _serve(tmp_path, host="0.0.0.0", plan_paths="true")
    try:
        sealed = _blocks("s", 2) | {"kv": kv_sample("gemma3-270m.bf16.layers8-9.bin")[:BLOCK]}
        async with aiohttp.ClientSession() as s:
            ts = await _tenant(s, srv.base, "s", "sealed")
            await _put(s, srv.base, ts, sealed)
            doc = await _plan(s, srv.base, ts, list(sealed))
            plan = parse_plan(doc, "", {})
            assert set(plan.blocks) == set(sealed)
            for k, v in sealed.items():
                b = plan.blocks[k]
                assert b.record is not None and b.record.frame_key is not None and b.path is not None
                assert _read(b) == v
            assert plan.blocks["kv"].stored_len < len(sealed["kv"])  # compressed on disk, read as stored
            assert await _release(s, srv.base, ts, plan.lease) == 204
            async with AsyncClient(srv.base, ts, plan_paths=True) as c:
                for k, v in sealed.items():
                    buf = bytearray(BLOCK + 10)
                    assert await c.get_into(k, buf) == len(v) and buf[: len(v)] == v
                assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (3, 0)
            async with AsyncClient(srv.base, ts, plan_paths=True, decode="server") as c:
                buf = bytearray(BLOCK + 10)
                assert await c.get_into("s0", buf) == BLOCK and buf[:BLOCK] == sealed["s0"]
                assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (0, 1)

            other = _non_loopback_address()
            if other is None:
                pytest.skip("no non-loopback address on this host")
            far = srv.base.replace("127.0.0.1", other)
            td = await _tenant(s, srv.base, "d", "direct")
            await _put(s, srv.base, td, {"d0": b"direct bytes"})
            doc = await _plan(s, far, ts, ["s0"])
            assert doc["blocks"][0]["status"] == 403 and doc["blocks"][0]["error"]["code"] == "insecure_transport"
            assert "record" not in doc["blocks"][0] and "frame_key" not in json.dumps(doc)
            doc = await _plan(s, far, td, ["d0"])
            assert _read(parse_plan(doc, "", {}).blocks["d0"]) == b"direct bytes"
            assert await _release(s, far, td, doc["lease"]) == 204
        async with AsyncClient(far, ts, plan_paths=True) as c:
            buf = bytearray(BLOCK + 10)
            assert await c.get_into("s1", buf) == BLOCK + 1 and buf[: BLOCK + 1] == sealed["s1"]
            assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (0, 1)
    finally:
        await srv.server.close()


def _non_loopback_address() -> str | None:
    """An IPv4 address of this host that is not loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
            addr: str = u.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


async def test_the_client_reads_through_path_plans_and_falls_back(
    paths_on: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = paths_on.base
    direct = _blocks("d", 6)
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, base, "d", "direct")
        await _put(s, base, token, direct)
    store = paths_on.server.app[STORE]
    async with AsyncClient(base, token, plan_paths=True) as c:
        for k, v in direct.items():
            buf = bytearray(BLOCK + 100)
            assert await c.get_into(k, buf) == len(v) and buf[: len(v)] == v
        assert await c.get_into("missing", bytearray(10)) is None
        assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (7, 0)
        assert not any(store.leases.held(("d", sid)) for sid in range(1, 4))  # each plan released

        # read_plan / read_planned / release_plan on an http endpoint.
        plan = await c.read_plan(["d0", "d1", "nope"], lease_s=5, paths=True)
        assert plan.endpoint == base and set(plan.blocks) == {"d0", "d1"} and plan.others["nope"][0] == 404
        buf = bytearray(BLOCK + 1)
        assert await c.read_planned(plan.blocks["d1"], buf) == BLOCK + 1 and buf == direct["d1"]
        assert store.leases.held(("d", 1))
        await c.release_plan(plan)
        assert not store.leases.held(("d", 1))
        with pytest.raises(ServerError, match="no such lease"):
            await c.release_plan(plan)

        # A file this host cannot open (not mounted, no permission, gone): GET.
        def unreadable(block: Any, buf: Any, pool: Any = None) -> int:
            raise FileNotFoundError(2, "No such file or directory", block.path)

        monkeypatch.setattr(PlanConnection, "read_into", staticmethod(unreadable))
        buf = bytearray(BLOCK + 100)
        assert await c.get_into("d2", buf) == BLOCK + 2 and buf[: BLOCK + 2] == direct["d2"]
        assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (7, 1)
        monkeypatch.undo()
        assert not any(store.leases.held(("d", sid)) for sid in range(1, 4))

    # A block whose file no longer holds its bytes fails its checksums: the
    # client reads it with GET, which the daemon checks too: never bytes.
    seg = paths_on.data_dir / "segments" / "d" / "0000000000000001.seg"
    data = bytearray(seg.read_bytes())
    at = data.index(direct["d1"][:64]) + 70_000
    with seg.open("r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x40]))
    async with AsyncClient(base, token, plan_paths=True) as c:
        buf = bytearray(BLOCK + 100)
        assert await c.get_into("d1", buf) is None  # fail-open: a miss
        assert (c.stats["plan_reads"], c.stats["plan_fallbacks"], c.stats["errors"]) == (0, 1, 1)
        assert await c.get_into("d0", buf) == BLOCK and buf[:BLOCK] == direct["d0"]
    async with AsyncClient(base, token, plan_paths=True, strict=True) as c:
        with pytest.raises(KVStoreClientError) as e:  # the record read or GET's checks, whichever it was
            await c.get_into("d1", bytearray(BLOCK + 100))
        assert e.value.code == "corruption"
        plan = await c.read_plan(["d1"], paths=True)
        with pytest.raises(CorruptBlock, match="frame 1 fails its checksum"):
            await c.read_planned(plan.blocks["d1"], bytearray(BLOCK + 1))
        await c.release_plan(plan)


@pytest.mark.parametrize("how", ["release", "expiry"])
async def test_a_path_lease_holds_a_segment_through_compaction(paths_on: Server, how: str) -> None:
    base = paths_on.base
    blocks = _blocks("c", 12)  # segments 1 and 2 sealed, 3 open
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, base, "c", "direct")
        other = await _tenant(s, base, "o", "direct")
        await _put(s, base, token, blocks)
        for k in ("c1", "c2", "c3", "c4"):  # segment 1 mostly dead: c0 is what is left
            async with s.delete(f"{base}/v1/blocks/{k}", headers=_h(token)) as r:
                assert r.status == 204
        first = paths_on.data_dir / "segments" / "c" / "0000000000000001.seg"
        doc = await _plan(s, base, token, ["c0"], lease_s=1.0 if how == "expiry" else 60.0)
        block = parse_plan(doc, "", {}).blocks["c0"]
        assert block.path == os.path.abspath(first)
        assert await _compact(s, base, "c") == 0  # leased: not rewritten
        assert _read(block) == blocks["c0"]
        assert await _release(s, base, other, doc["lease"]) == 404  # another tenant's: not found
        if how == "release":
            async with aiohttp.ClientSession() as s2:  # another connection of the same tenant
                assert await _release(s2, base, token, doc["lease"]) == 204
        deadline = time.monotonic() + 15
        while await _compact(s, base, "c") == 0:
            assert time.monotonic() < deadline, f"{how}: the lease was never let go"
            await asyncio.sleep(0.3)
        assert not first.exists()
        # The lease ended and the file went: a read from the old path fails,
        # it never gives other bytes; a new plan names c0's new file.
        with pytest.raises(FileNotFoundError):
            _read(block)
        again = parse_plan(await _plan(s, base, token, ["c0"]), "", {})
        assert again.blocks["c0"].path != block.path and _read(again.blocks["c0"]) == blocks["c0"]
        assert await _release(s, base, token, again.lease) == 204
        assert await _get(s, base, token, "c0") == blocks["c0"]
        assert await _release(s, base, token, doc["lease"]) == 404  # released or expired: gone


def test_leases_released_by_their_tenant_only() -> None:
    leases = Leases()
    owned = leases.acquire([("t", 1)], 60, owner="t")
    held = leases.acquire([("t", 2)], 60)
    short = leases.acquire([("t", 3)], 0.01, owner="t")
    assert not leases.release_owned(owned.id, "u") and leases.held(("t", 1))
    assert not leases.release_owned(held.id, "t") and leases.held(("t", 2))  # a connection's
    time.sleep(0.02)
    assert not leases.release_owned(short.id, "t")  # expired
    assert leases.release_owned(owned.id, "t") and not leases.held(("t", 1))
    assert not leases.release_owned(owned.id, "t")
    leases.acquire([("t", 4)], 0.01, owner="t")
    time.sleep(0.02)
    assert leases.forget_expired() == 1


# -- a daemon with several workers, on TCP and a unix socket ---------------------


def _start(daemon: Daemon, sock_dir: Path, workers: int) -> str:
    sock = str(sock_dir / "kv.sock")
    daemon.extra = ["--listen", f"unix:{sock}", "--compact-interval-s", "0", "--plan-paths", "true"]
    daemon.extra += ["--workers", str(workers)]
    daemon.start()
    return sock


async def _session_on(base: str, role: str) -> aiohttp.ClientSession:
    """A session whose one kept-alive connection landed on a worker of ``role``."""
    for _ in range(100):
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, force_close=False))
        async with s.get(base + "/healthz") as r:
            got = (await r.json())["role"]
        if got == role:
            return s
        await s.close()
    raise AssertionError(f"no connection landed on a {role} worker")


@pytest.mark.parametrize("workers", [1, 2])
async def test_path_leases_on_every_worker_and_listener(daemon: Daemon, sock_dir: Path, workers: int) -> None:
    """Whichever worker grants a path plan, the writer (which compacts)
    holds its lease, and a release on any worker's connection lets it go.
    Plans with paths work on the unix socket too; a descriptor plan's lease
    is not released over TCP."""
    sock = _start(daemon, sock_dir, workers)
    base = daemon.base
    blocks = _blocks("c", 12)
    roles = ["single"] if workers == 1 else ["reader", "writer"]
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, base, "c", "direct")
        other = await _tenant(s, base, "o", "direct")
        await _put(s, base, token, blocks)
        for k in ("c1", "c2", "c3", "c4"):
            async with s.delete(f"{base}/v1/blocks/{k}", headers=_h(token)) as r:
                assert r.status == 204
        first = daemon.data_dir / "segments" / "c" / "0000000000000001.seg"
        sessions = {role: await _session_on(base, role) for role in roles}
        try:
            # Granted on each worker, released on each (the other one first).
            for grant in roles:
                for release in reversed(roles):
                    doc = await _plan(sessions[grant], base, token, ["c0", "c6"])
                    plan = parse_plan(doc, "", {})
                    assert _read(plan.blocks["c0"]) == blocks["c0"] and _read(plan.blocks["c6"]) == blocks["c6"]
                    assert await _compact(s, base, "c") == 0, (grant, release)  # the writer holds it
                    assert await _release(sessions[release], base, other, plan.lease) == 404
                    assert await _release(sessions[release], base, token, plan.lease) == 204, (grant, release)
                    assert await _release(sessions[release], base, token, plan.lease) == 404
                    # A reader that granted it may still hold its own copy (the writer's is gone).
                    assert await _release(sessions[grant], base, token, plan.lease) in (404, 204)
            assert first.exists()
            # Over the unix socket: a plan with paths, released over TCP; a
            # plan with descriptors, not released over TCP (its connection's).
            conn = PlanConnection(sock, token)
            try:
                on_unix = conn.plan(["c0"], paths=True)
                assert on_unix.blocks["c0"].path == os.path.abspath(first) and conn._fds == {}
                assert _read(on_unix.blocks["c0"]) == blocks["c0"]
                described = conn.plan(["c0"])
                assert described.blocks["c0"].path is None and described.blocks["c0"].fd >= 0
                assert await _release(s, base, token, described.lease) == 404
                assert await _release(s, base, token, on_unix.lease) == 204
                assert await _compact(s, base, "c") == 0  # the descriptor plan's lease still holds
                conn.release(described.lease)
            finally:
                conn.close()
            deadline = time.monotonic() + 15
            while await _compact(s, base, "c") == 0:
                assert time.monotonic() < deadline, "the leases were never let go"
                await asyncio.sleep(0.3)
            assert not first.exists()
            # The client library, on whichever worker its connections land.
            async with AsyncClient(base, token, plan_paths=True) as c:
                for k in ("c0", "c5", "c11"):
                    buf = bytearray(BLOCK + 100)
                    assert await c.get_into(k, buf) == len(blocks[k]) and buf[: len(blocks[k])] == blocks[k]
                assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (3, 0)
        finally:
            for sess in sessions.values():
                await sess.close()
    assert daemon.stop() == 0


_OTHER_USER = r"""
import asyncio, json, os, sys
from kvstore_client import AsyncClient
base, token, keys = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
os.setgroups([]); os.setgid(65534); os.setuid(65534)  # nobody: no access to the data directory

async def main():
    out = {}
    async with AsyncClient(base, token, plan_paths=True) as c:
        for k in keys:
            buf = bytearray(1 << 20)
            n = await c.get_into(k, buf)
            out[k] = bytes(buf[:n]).hex()
        out["_stats"] = [c.stats["plan_reads"], c.stats["plan_fallbacks"]]
    print(json.dumps(out))

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
async def test_a_client_without_permission_on_the_files_reads_over_http(paths_on: Server) -> None:
    direct = _blocks("u", 2)
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, paths_on.base, "u", "direct")
        await _put(s, paths_on.base, token, direct)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT / "clients")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _OTHER_USER,
        paths_on.base,
        token,
        json.dumps(list(direct)),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    got = json.loads(out)
    assert got.pop("_stats") == [0, 2]  # EACCES on every path: GET
    assert {k: bytes.fromhex(v) for k, v in got.items()} == direct

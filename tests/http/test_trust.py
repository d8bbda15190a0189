"""Issue 10 through the daemon: the lifecycle seen from every worker
(/proc/PID/fd), quotas, TTL and compaction over HTTP, and start-up with a lost
registry."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.http.conftest import ADMIN, ROOT, Daemon
from tests.http.rawhttp import Conn, worker_connections

KiB = 1024
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


def block(key: str, size: int = 48 * KiB) -> bytes:
    return random.Random(key).randbytes(size)  # incompressible: stored bytes ~ its size


def open_segment_files(pid: int, data_dir: Path) -> list[str]:
    """The segment files (deleted or not) process ``pid`` holds open."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(str(data_dir)) and ".seg" in target:
            out.append(target)
    return out


async def _tenant(conn: Conn, name: str, **fields: object) -> str:
    r = await conn.request("POST", "/v1/admin/tenants", ADMIN_H, json.dumps({"name": name, **fields}).encode())
    assert r.status == 201, r.body
    token: str = r.json()["token"]
    return token


async def _wait_closed(pids: dict[str, int], data_dir: Path, gone: str, limit: float = 10.0) -> float:
    t0 = time.monotonic()
    while True:
        held = {
            role: [f for f in open_segment_files(pid, data_dir) if f"/{gone}/" in f or f"/.trash/{gone}." in f]
            for role, pid in pids.items()
        }
        if not any(held.values()):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < limit, f"still open after {limit} s: {held}"
        await asyncio.sleep(0.1)


async def test_reader_workers_kept_deleted_segments_open(daemon: Daemon) -> None:
    """With --workers 2, a reader kept a deleted tenant's segment files open
    (the space came back only when the daemon stopped), and so for segments
    dropped or compacted away. Readers now follow the lifecycle epoch and
    close them within about a second."""
    daemon.extra = ["--workers", "2"]
    daemon.env["KVSTORE_COMPACT_INTERVAL_S"] = "0"
    daemon.start()
    conns = await worker_connections("127.0.0.1", daemon.port)
    try:
        pids = {role: (await c.request("GET", "/healthz")).json()["pid"] for role, c in conns.items()}
        w, r = conns["writer"], conns["reader"]
        tokens = {name: await _tenant(w, name) for name in ("t1", "t2")}
        keys = [f"k{i}" for i in range(60)]  # ~3 MiB: several 1 MiB segments each
        for name, token in tokens.items():
            h = {"Authorization": f"Bearer {token}"}
            for k in keys:
                assert (await w.request("PUT", f"/v1/blocks/{k}", h, block(name + k))).status == 201
        assert (await w.request("POST", "/v1/admin/flush", ADMIN_H, b"")).status == 200
        for name, token in tokens.items():  # the reader opens every segment
            h = {"Authorization": f"Bearer {token}"}
            for k in keys:
                got = await r.request("GET", f"/v1/blocks/{k}", h)
                assert got.status == 200 and got.body == block(name + k)
        assert len([f for f in open_segment_files(pids["reader"], daemon.data_dir) if "/t1/" in f]) >= 3

        # Deleted tenant: every worker lets go of its files.
        assert (await w.request("DELETE", "/v1/admin/tenants/t1", ADMIN_H)).status == 204
        waited = await _wait_closed(pids, daemon.data_dir, "t1")
        assert waited < 5

        # Compacted segments: the reader lets go of the retired ones.
        h2 = {"Authorization": f"Bearer {tokens['t2']}"}
        for k in keys[: len(keys) * 3 // 4]:
            assert (await w.request("DELETE", f"/v1/blocks/{k}", h2)).status == 204
        rep = await w.request("POST", "/v1/admin/compact", ADMIN_H, b"")
        assert rep.status == 200 and rep.json()["segments_rewritten"] >= 2, rep.body
        t0 = time.monotonic()
        while True:
            held = [f for pid in pids.values() for f in open_segment_files(pid, daemon.data_dir)]
            gone = [f for f in held if f.endswith("(deleted)") or not Path(f).exists()]
            if not gone:
                break
            assert time.monotonic() - t0 < 5, f"compacted segments still open: {gone}"
            await asyncio.sleep(0.1)
        for k in keys[len(keys) * 3 // 4 :]:  # what is left reads back, through both workers
            for c in conns.values():
                got = await c.request("GET", f"/v1/blocks/{k}", h2)
                assert got.status == 200 and got.body == block("t2" + k)
    finally:
        for c in conns.values():
            await c.close()


async def test_quotas_ttl_and_compaction_over_http(daemon: Daemon) -> None:
    daemon.env["KVSTORE_COMPACT_INTERVAL_S"] = "0"
    daemon.start()
    w = await Conn.open("127.0.0.1", daemon.port)
    try:
        bad = await w.request("POST", "/v1/admin/tenants", ADMIN_H, b'{"name": "q", "quota_bytes": -1}')
        assert bad.status == 400 and "quota_bytes" in bad.json()["error"]["message"]
        token = await _tenant(w, "q", quota_bytes=512 * KiB)
        h = {"Authorization": f"Bearer {token}"}
        got = (await w.request("GET", "/v1/admin/tenants/q", ADMIN_H)).json()
        assert got["quota_bytes"] == 512 * KiB and got["ttl_s"] is None and got["bytes_stored"] == 0
        big = await w.request("PUT", "/v1/blocks/huge", h, block("huge", 600 * KiB))
        assert big.status == 507 and big.code == "quota_exceeded"
        for i in range(30):
            assert (await w.request("PUT", f"/v1/blocks/k{i}", h, block(f"k{i}"))).status == 201
        stats = (await w.request("GET", "/v1/stats", h)).json()
        assert stats["bytes_stored"] <= 512 * KiB
        patched = await w.request("PATCH", "/v1/admin/tenants/q", ADMIN_H, b'{"quota_bytes": null, "ttl_s": 3600}')
        assert patched.status == 200, patched.body
        assert patched.json()["quota_bytes"] is None and patched.json()["ttl_s"] == 3600
        for body in (b"{}", b'{"ttl_s": "1h"}', b'{"policy": "direct"}', b'{"ttl_s": 1.5}'):
            r = await w.request("PATCH", "/v1/admin/tenants/q", ADMIN_H, body)
            assert r.status == 400 and r.code == "invalid_input", (body, r.body)
        r = await w.request("PATCH", "/v1/admin/tenants/nobody", ADMIN_H, b'{"ttl_s": 5}')
        assert r.status == 404
        patched = await w.request("PATCH", "/v1/admin/tenants/q", ADMIN_H, b'{"frame_size": 262144}')
        assert patched.status == 200 and patched.json()["frame_size"] == 262144, patched.body
        r = await w.request("PATCH", "/v1/admin/tenants/q", ADMIN_H, b'{"frame_size": 1000}')
        assert r.status == 400 and "frame_size" in r.json()["error"]["message"], r.body
        rep = await w.request("POST", "/v1/admin/compact?tenant=q", ADMIN_H, b"")
        assert rep.status == 200 and {"segments_rewritten", "bytes_reclaimed"} <= set(rep.json())
        r = await w.request("POST", "/v1/admin/compact?tenant=..", ADMIN_H, b"")
        assert r.status == 400
    finally:
        await w.close()


async def test_reads_on_a_reader_keep_blocks_hot(daemon: Daemon) -> None:
    """Access times of reads served by a reader worker reach the writer, which
    owns the quota's LRU order."""
    daemon.extra = ["--workers", "2"]
    daemon.start()
    conns = await worker_connections("127.0.0.1", daemon.port)
    try:
        w, r = conns["writer"], conns["reader"]
        token = await _tenant(w, "q", quota_bytes=1024 * KiB)
        h = {"Authorization": f"Bearer {token}"}
        hot = [f"hot{i}" for i in range(4)]
        for k in hot:
            assert (await w.request("PUT", f"/v1/blocks/{k}", h, block(k))).status == 201
        for i in range(40):  # ~2 MiB through a 1 MiB quota; the hot ones read on the reader only
            assert (await w.request("PUT", f"/v1/blocks/c{i}", h, block(f"c{i}"))).status == 201
            if i % 4 == 0:
                for k in hot:
                    assert (await r.request("GET", f"/v1/blocks/{k}", h)).status == 200
                await asyncio.sleep(1.2)  # the reader hands its accesses over every second
        for k in hot:
            assert (await w.request("HEAD", f"/v1/blocks/{k}", h)).status == 200, f"{k} was evicted"
        assert (await w.request("HEAD", "/v1/blocks/c0", h)).status == 404
    finally:
        for c in conns.values():
            await c.close()


def test_startup_without_registry_refuses_and_names_the_tenants(daemon: Daemon) -> None:
    daemon.start()

    async def fill() -> None:
        c = await Conn.open("127.0.0.1", daemon.port)
        try:
            token = await _tenant(c, "acme", policy="direct")
            r = await c.request("PUT", "/v1/blocks/k", {"Authorization": f"Bearer {token}"}, b"plaintext" * 100)
            assert r.status == 201
        finally:
            await c.close()

    asyncio.run(fill())
    assert daemon.stop(signal.SIGTERM) == 0
    registry = daemon.data_dir / "registry.json"
    saved = registry.read_bytes()
    registry.unlink()
    cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(daemon.data_dir), "--listen", "127.0.0.1:0"]
    out = subprocess.run(cmd, env=daemon.env, capture_output=True, timeout=60, text=True)
    assert out.returncode == 2, out.stderr
    assert "acme" in out.stderr and "registry.json" in out.stderr and "discard_unknown_tenants" in out.stderr
    assert list((daemon.data_dir / "segments" / "acme").glob("*.seg")), "the tenant's data was deleted"
    registry.write_bytes(saved)
    daemon.start()
    daemon.stop()


def test_supervisor_whose_writer_cannot_open_the_store_exits_cleanly(daemon: Daemon) -> None:
    """A supervisor whose writer died at start-up (here: the store is locked
    by a running daemon) crashed with a traceback in its pipe; it exits 2 now,
    as one process does for a start-up error, and the writer's own message says why."""
    daemon.extra = ["--workers", "2"]
    daemon.start()
    try:
        cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(daemon.data_dir)]
        cmd += ["--listen", "127.0.0.1:0", "--workers", "2"]
        out = subprocess.run(cmd, env=daemon.env, capture_output=True, timeout=60, text=True)
        assert out.returncode == 2, out.stderr
        assert "in use by another process" in out.stderr and "Traceback" not in out.stderr, out.stderr
    finally:
        daemon.stop()

"""Read plans over the unix socket: a client on the host reads direct blocks
from the segment files through descriptors the daemon passes (SCM_RIGHTS),
checks them against the daemon's checksums, and GETs what a plan cannot
give. Leases keep segments through compaction until released, expired or
disconnected; a passed descriptor reads the right bytes even after."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest
from kvstore_client import AsyncClient
from kvstore_client.errors import CorruptBlock
from kvstore_client.plans import PlanConnection

from ..conftest import kv_sample
from .conftest import ADMIN, ROOT, Daemon
from .openapi import Spec

BLOCK = 200_000  # five to a 1 MiB segment


async def _admin(session: aiohttp.ClientSession, base: str, method: str, path: str, body: object = None) -> object:
    async with session.request(method, base + path, json=body, headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status < 300, await r.text()
        return await r.json() if r.content_type == "application/json" else None


async def _tenant(session: aiohttp.ClientSession, base: str, name: str, policy: str) -> str:
    doc = await _admin(session, base, "POST", "/v1/admin/tenants", {"name": name, "policy": policy})
    assert isinstance(doc, dict)
    return str(doc["token"])


async def _put(session: aiohttp.ClientSession, base: str, token: str, blocks: dict[str, bytes]) -> None:
    for k, v in blocks.items():
        async with session.put(
            f"{base}/v1/blocks/{k}", data=io.BytesIO(v), headers={"Authorization": f"Bearer {token}"}
        ) as r:
            assert r.status == 201, await r.text()


def _blocks(prefix: str, n: int) -> dict[str, bytes]:
    return {f"{prefix}{i}": random.Random(f"{prefix}{i}").randbytes(BLOCK + i) for i in range(n)}


def _start(daemon: Daemon, sock_dir: Path, workers: int = 1) -> str:
    sock = str(sock_dir / "kv.sock")
    daemon.extra = ["--listen", f"unix:{sock}", "--unix-socket-mode", "0666", "--compact-interval-s", "0"]
    daemon.extra += ["--workers", str(workers)]
    daemon.start()
    return sock


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_plan_reads_direct_blocks_and_names_the_rest(daemon: Daemon, sock_dir: Path, workers: int) -> None:
    sock = _start(daemon, sock_dir, workers)
    direct, sealed = _blocks("d", 12), _blocks("s", 2) | {"kv": kv_sample("gemma3-270m.bf16.layers8-9.bin")[:BLOCK]}
    async with aiohttp.ClientSession() as s:
        td = await _tenant(s, daemon.base, "d", "direct")
        ts = await _tenant(s, daemon.base, "s", "sealed")
        await _put(s, daemon.base, td, direct)
        await _put(s, daemon.base, ts, sealed)
        async with s.post(
            daemon.base + "/v1/read-plan", json={"keys": ["d0"]}, headers={"Authorization": f"Bearer {td}"}
        ) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "unix_socket_required"
    conn = PlanConnection(sock, td)
    try:
        plan = conn.plan([*direct, "missing", "bad/key"])
        assert set(plan.blocks) == set(direct)
        assert plan.others == {"missing": (404, "not_found"), "bad/key": (400, "invalid_key")}
        for k, v in direct.items():
            buf = bytearray(len(v))
            assert conn.read_into(plan.blocks[k], buf) == len(v) and buf == v
        files = {b.fd for b in plan.blocks.values()}
        assert 2 <= len(files) <= 4  # one descriptor per segment, not per block
        again = conn.plan(["d0", "d11"])  # the same segments: no descriptor passed twice
        assert {again.blocks["d0"].fd, again.blocks["d11"].fd} <= files
        # The answer is what docs/openapi.yaml describes.
        status, doc, fds = conn._exchange("POST", "/v1/read-plan", json.dumps({"keys": ["d0", "zz"]}).encode())
        assert status == 200 and fds == [] and doc["files"] == []
        assert Spec.load().problems("POST", "/v1/read-plan", 200, "application/json", json.dumps(doc).encode()) == []
        conn.release(doc["lease"])
        conn.release(plan.lease)
        conn.release(again.lease)
        with pytest.raises(Exception, match="no such lease"):
            conn.release(plan.lease)
    finally:
        conn.close()
    # Sealed blocks: the plan carries each record's own key and frame table;
    # the client reads the stored frames and opens them itself.
    sealed_conn = PlanConnection(sock, ts)
    try:
        p = sealed_conn.plan(list(sealed))
        assert set(p.blocks) == set(sealed) and not p.others
        with ThreadPoolExecutor(2) as pool:
            for k, v in sealed.items():
                b = p.blocks[k]
                assert b.record is not None and b.record.frame_key is not None
                buf = bytearray(len(v))
                assert sealed_conn.read_into(b, buf, pool) == len(v) and buf == v
        assert p.blocks["kv"].stored_len < len(sealed["kv"])  # compressed on disk, read as stored
        status, doc, _ = sealed_conn._exchange("POST", "/v1/read-plan", json.dumps({"keys": ["kv"]}).encode())
        assert Spec.load().problems("POST", "/v1/read-plan", 200, "application/json", json.dumps(doc).encode()) == []
        sealed_conn.release(doc["lease"])
    finally:
        sealed_conn.close()

    # The client library: plans for direct blocks, GET for the rest, misses are misses.
    async with AsyncClient(f"unix:{sock}", td) as c:
        for k, v in list(direct.items())[:4]:
            buf = bytearray(BLOCK + 100)
            assert await c.get_into(k, buf) == len(v) and buf[: len(v)] == v
        assert await c.get_into("missing", bytearray(10)) is None
        assert c.stats["plan_reads"] == 5 and c.stats["plan_fallbacks"] == 0
        # A batch: one plan for all its keys; a miss, and a buffer too small
        # (that key alone fails, the rest are read).
        keys = [*direct, "missing", "d0"]
        bufs = [bytearray(BLOCK + 100) for _ in direct] + [bytearray(10), bytearray(10)]
        assert await c.get_many_into(keys, bufs) == [len(v) for v in direct.values()] + [None, None]
        assert all(b[: len(v)] == v for b, v in zip(bufs, direct.values(), strict=False))
        # the miss counts: the plan answered it, as for get_into
        assert c.stats["plan_reads"] == 5 + len(direct) + 1 and c.stats["plan_fallbacks"] == 0
    async with AsyncClient(f"unix:{sock}", ts) as c:
        buf = bytearray(BLOCK + 100)
        assert await c.get_into("s1", buf) == BLOCK + 1 and buf[: BLOCK + 1] == sealed["s1"]
        assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (1, 0)
    async with AsyncClient(f"unix:{sock}", ts, decode="server") as c:  # the daemon decodes: GET
        buf = bytearray(BLOCK + 100)
        assert await c.get_into("s1", buf) == BLOCK + 1 and buf[: BLOCK + 1] == sealed["s1"]
        assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (0, 1)
        bufs = [bytearray(BLOCK + 100) for _ in sealed]
        assert await c.get_many_into(list(sealed), bufs) == [len(v) for v in sealed.values()]
        assert all(b[: len(v)] == v for b, v in zip(bufs, sealed.values(), strict=True))
        assert (c.stats["plan_reads"], c.stats["plan_fallbacks"]) == (0, 1 + len(sealed))
    assert daemon.stop() == 0


_OTHER_USER = r"""
import json, os, sys
from kvstore_client.plans import PlanConnection
sock, token, keys = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
os.setgroups([]); os.setgid(65534); os.setuid(65534)  # nobody: no access to the data directory
conn = PlanConnection(sock, token)
plan = conn.plan(keys)
out = {}
for k, b in plan.blocks.items():
    buf = bytearray(b.size)
    conn.read_into(b, buf)
    out[k] = buf.hex()
data_dir = sys.argv[4]
try:
    os.listdir(data_dir)
    out["_data_dir"] = "readable"
except PermissionError:
    out["_data_dir"] = "denied"
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
async def test_another_user_reads_through_passed_descriptors(daemon: Daemon, sock_dir: Path) -> None:
    sock = _start(daemon, sock_dir)
    direct = _blocks("u", 3)
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, daemon.base, "u", "direct")
        await _put(s, daemon.base, token, direct)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT / "clients")}
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_USER, sock, token, json.dumps(list(direct)), str(daemon.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got.pop("_data_dir") == "denied"
    assert {k: bytes.fromhex(v) for k, v in got.items()} == direct
    assert daemon.stop() == 0


def _deleted_segments_open(tenant: str) -> list[str]:
    """Removed segment files of ``tenant`` this process still holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if f"/segments/{tenant}/" in target and target.endswith(" (deleted)"):
            out.append(target)
    return sorted(out)


async def _compact(session: aiohttp.ClientSession, base: str, tenant: str) -> int:
    rep = await _admin(session, base, "POST", f"/v1/admin/compact?tenant={tenant}")
    assert isinstance(rep, dict)
    return int(rep["segments_rewritten"])


def _reader_connection(sock: str, token: str) -> PlanConnection:
    """A plan connection that a reader worker holds (--workers 2): its leases
    are the ones the writer, which compacts and evicts, must be told of."""
    for _ in range(50):
        conn = PlanConnection(sock, token)
        status, doc, _ = conn._exchange("GET", "/healthz", None)
        if status == 200 and doc["role"] == "reader":
            return conn
        conn.close()
    raise AssertionError("no connection landed on a reader worker")


@pytest.mark.parametrize(("how", "workers"), [(h, w) for w in (1, 2) for h in ("release", "disconnect", "expiry")])
async def test_a_lease_holds_a_segment_through_compaction(
    daemon: Daemon, sock_dir: Path, how: str, workers: int
) -> None:
    sock = _start(daemon, sock_dir, workers)
    blocks = _blocks("c", 12)  # segments 1 and 2 sealed, 3 open
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, daemon.base, "c", "direct")
        await _put(s, daemon.base, token, blocks)
        h = {"Authorization": f"Bearer {token}"}
        for k in ("c1", "c2", "c3", "c4"):  # segment 1 mostly dead: c0 is what is left
            async with s.delete(f"{daemon.base}/v1/blocks/{k}", headers=h) as r:
                assert r.status == 204
        first = daemon.data_dir / "segments" / "c" / "0000000000000001.seg"
        assert first.exists()
        conn = PlanConnection(sock, token) if workers == 1 else _reader_connection(sock, token)
        plan = conn.plan(["c0"], lease_s=1.0 if how == "expiry" else 60.0)
        block = plan.blocks["c0"]
        assert await _compact(s, daemon.base, "c") == 0  # leased: not rewritten
        if how == "release":
            conn.release(plan.lease)
        elif how == "disconnect":  # the connection ends; its descriptors stay open here
            assert conn._sock is not None
            conn._sock.close()
            conn._sock = None
        deadline = time.monotonic() + 15
        while await _compact(s, daemon.base, "c") == 0:
            assert time.monotonic() < deadline, f"{how}: the lease was never let go"
            await asyncio.sleep(0.3)
        assert not first.exists()
        # Its file is gone: the descriptor still reads c0's bytes, and so does a GET.
        buf = bytearray(block.size)
        assert conn.read_into(block, buf) == len(blocks["c0"]) and buf == blocks["c0"]
        assert _deleted_segments_open("c") == [str(first) + " (deleted)"]
        if how == "release":
            # The next plan on this connection tells the client to let go of
            # the removed file, and the client does once its plans are released.
            later = conn.plan(["c6"])
            assert _deleted_segments_open("c") == [str(first) + " (deleted)"]
            conn.release(later.lease)
            assert _deleted_segments_open("c") == []
        conn.close()
        assert _deleted_segments_open("c") == []
        async with s.get(f"{daemon.base}/v1/blocks/c0", headers=h) as r:
            assert await r.read() == blocks["c0"]
    assert daemon.stop() == 0


async def test_a_tampered_block_raises_and_a_deleted_tenant_has_no_plan(daemon: Daemon, sock_dir: Path) -> None:
    sock = _start(daemon, sock_dir)
    blocks = _blocks("t", 2)
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, daemon.base, "t", "direct")
        await _put(s, daemon.base, token, blocks)
        seg = next((daemon.data_dir / "segments" / "t").glob("*.seg"))
        data = bytearray(seg.read_bytes())
        at = data.index(blocks["t1"][:64]) + 70_000
        with seg.open("r+b") as f:
            f.seek(at)
            f.write(bytes([data[at] ^ 0x40]))
        conn = PlanConnection(sock, token)
        plan = conn.plan(["t0", "t1"])
        buf = bytearray(BLOCK + 10)
        assert conn.read_into(plan.blocks["t0"], buf) == BLOCK
        with pytest.raises(CorruptBlock, match="frame 1 fails its checksum"):
            conn.read_into(plan.blocks["t1"], buf)
        async with AsyncClient(f"unix:{sock}", token, strict=True) as c:
            with pytest.raises(CorruptBlock):
                await c.get_into("t1", bytearray(BLOCK + 10))
        await _admin(s, daemon.base, "DELETE", "/v1/admin/tenants/t")
        with pytest.raises(Exception, match="401"):
            conn.plan(["t0"])
        conn.close()
    assert daemon.stop() == 0


async def test_plans_while_writes_deletes_and_compaction_run(daemon: Daemon, sock_dir: Path) -> None:
    """Plans and their reads go on while clients write and delete and the
    compactor rewrites segments in a loop: every planned block reads back
    its own bytes (never another's), and every acknowledged block reads back
    at the end."""
    sock = _start(daemon, sock_dir)
    live: dict[str, bytes] = {}
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, daemon.base, "w", "direct")
        h = {"Authorization": f"Bearer {token}"}
        stop = asyncio.Event()
        planned_reads = rewritten = 0

        async def writer() -> None:
            rng = random.Random(7)
            i = 0
            while not stop.is_set():
                k = f"w{i}"
                v = rng.randbytes(rng.randrange(50_000, 300_000))
                await _put(s, daemon.base, token, {k: v})
                live[k] = v
                if i % 3 == 0 and len(live) > 4:  # deletes leave dead bytes for the compactor
                    victim = rng.choice(sorted(live))
                    async with s.delete(f"{daemon.base}/v1/blocks/{victim}", headers=h) as r:
                        assert r.status == 204
                    del live[victim]
                i += 1

        async def compactor() -> None:
            nonlocal rewritten
            while not stop.is_set():
                rewritten += await _compact(s, daemon.base, "w")
                await asyncio.sleep(0.05)

        def planner() -> None:
            nonlocal planned_reads
            conn = PlanConnection(sock, token)
            try:
                while not stop.is_set():
                    keys = sorted(live)[-40:]
                    if not keys:
                        time.sleep(0.01)
                        continue
                    snapshot = {k: live.get(k) for k in keys}
                    plan = conn.plan(keys)
                    for k, b in plan.blocks.items():
                        buf = bytearray(b.size)
                        conn.read_into(b, buf)  # checked frame by frame
                        if snapshot[k] is not None:  # keys are never written twice: these are its bytes
                            assert buf == snapshot[k], k
                        planned_reads += 1
                    conn.release(plan.lease)
            finally:
                conn.close()

        tasks = [asyncio.create_task(writer()), asyncio.create_task(compactor())]
        plans = asyncio.create_task(asyncio.to_thread(planner))
        await asyncio.sleep(6)
        stop.set()
        await asyncio.gather(*tasks, plans)
        assert planned_reads > 50 and rewritten > 0, (planned_reads, rewritten)
        for k, v in live.items():
            async with s.get(f"{daemon.base}/v1/blocks/{k}", headers=h) as r:
                assert r.status == 200 and await r.read() == v, k
    assert _deleted_segments_open("w") == []
    assert daemon.stop() == 0


async def test_a_plan_descriptor_is_read_only_and_the_clients_own(daemon: Daemon, sock_dir: Path) -> None:
    """The descriptor passed is a read-only description of its own: the
    client cannot write through it, and flags it sets (O_APPEND, O_DIRECT)
    never reach the daemon's descriptor of the same file."""
    import errno
    import fcntl

    sock = _start(daemon, sock_dir)
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, daemon.base, "d", "direct")
        blocks = _blocks("r", 3)
        await _put(s, daemon.base, token, blocks)
    conn = PlanConnection(sock, token)
    try:
        plan = conn.plan(list(blocks))
        fd = plan.blocks["r0"].fd
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"x", 0)
        assert e.value.errno == errno.EBADF
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        conn.release(plan.lease)
    finally:
        conn.close()
    async with aiohttp.ClientSession() as s:
        more = _blocks("after", 3)
        await _put(s, daemon.base, token, more)  # appended where the daemon means to, O_APPEND or not
    async with AsyncClient(daemon.base, token) as c:
        for k, v in (blocks | more).items():
            assert await c.get(k) == v

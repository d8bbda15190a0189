"""NIXL transfers between two real agents in two processes (the daemon and
this test), over UCX on TCP on 127.0.0.1: reads byte-identical to HTTP for
direct and sealed tenants, writes over NIXL read back over HTTP, leases
(release, expiry, a segment compacted under one), tenant isolation of
agents, bad input, faults, and the RDMA status without devices."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import json
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvstore_client import AsyncClient
from kvstore_client.nixl import MAX_REGISTERED, NixlAgent, NixlFallback, nixl_available
from kvstore_client.prefix import DEADLINE_SLACK_S

from ..conftest import kv_sample
from .conftest import ADMIN, Daemon
from .openapi import Spec
from .test_read_plans import _admin, _put, _tenant

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install --no-deps nixl-cu12 nixl; tests/run.sh does)"
)
BLOCK = 200_000  # spans frames of 64 KiB; five to a 1 MiB segment


@pytest.fixture(autouse=True)
def _ucx_over_tcp_on_lo(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's agent: loopback only, TCP (not shared memory)."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "tcp")


def _start(daemon: Daemon, workers: int = 1, **settings: str) -> None:
    daemon.env |= {"KVSTORE_NIXL": "1", "KVSTORE_NIXL_DEVICES": "lo", "UCX_TLS": "tcp"}
    daemon.env |= {"KVSTORE_" + k.upper(): v for k, v in settings.items()}
    daemon.extra = ["--compact-interval-s", "0", "--workers", str(workers)]
    daemon.start()


def _blocks(prefix: str, n: int) -> dict[str, bytes]:
    return {f"{prefix}{i}": random.Random(f"{prefix}{i}").randbytes(BLOCK + i) for i in range(n)}


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _post(s: aiohttp.ClientSession, base: str, token: str, path: str, doc: object) -> tuple[int, Any]:
    async with s.post(base + path, json=doc, headers=_auth(token)) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else None)


def _addr(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


async def _read_many(
    agent: NixlAgent, s: aiohttp.ClientSession, base: str, keys: list[str], sizes: int
) -> tuple[dict[str, bytes], dict[str, int], str]:
    """One control call for many keys, one READ of every hit into one buffer."""
    daemon, doc = await agent._call(s, base, "/v1/xfer/read", {"agent": agent.name, "keys": keys})
    if doc["metadata"]:
        agent.agent.add_remote_agent(base64.b64decode(doc["metadata"]))
    buf = bytearray(sizes)
    base_addr = _addr(buf)
    local, remote, spans, at = [], [], {}, 0
    misses = {}
    for b in doc["blocks"]:
        if b["status"] != 200:
            misses[b["key"]] = b["status"]
            continue
        local.append((base_addr + at, b["len"], 0))
        remote.append((b["addr"], b["len"], b["dev"]))
        spans[b["key"]] = (at, b["len"])
        at += b["len"]
    agent._register(buf, base_addr, sizes, "DRAM", 0)
    await agent._transfer("READ", daemon, local, remote, "DRAM", time.monotonic() + 10)
    return {k: bytes(buf[o : o + n]) for k, (o, n) in spans.items()}, misses, doc["lease"]


@pytest.mark.parametrize("workers", [1, 2])
async def test_reads_match_http_for_direct_and_sealed_tenants(
    daemon: Daemon, session: aiohttp.ClientSession, workers: int
) -> None:
    _start(daemon, workers)
    base = daemon.base
    direct = _blocks("d", 8)
    sealed = _blocks("s", 3) | {"kv": kv_sample("gemma3-270m.bf16.layers8-9.bin")[: 3 * BLOCK]}
    td = await _tenant(session, base, "d", "direct")
    ts = await _tenant(session, base, "s", "sealed")
    await _put(session, base, td, direct)
    await _put(session, base, ts, sealed)
    for token, blocks in ((td, direct), (ts, sealed)):
        async with AsyncClient(base, token, transport="nixl", timeout=10) as c:
            for k, v in blocks.items():
                buf = bytearray(len(v) + 10)
                assert await c.get_into(k, buf) == len(v)
                assert buf[: len(v)] == v, k
            assert await c.get_into("missing", bytearray(10)) is None
            assert c.stats["nixl_reads"] == len(blocks) + 1 and c.stats["nixl_fallbacks"] == 0
            # Many keys in one call, misses and bad keys mixed in, one READ for all hits.
            agent = c._nixl.agent()
            got, misses, lease = await _read_many(
                agent, c._x.session(c._x.endpoints[base]), base, [*blocks, "nope", "bad/key"], 8 * BLOCK + 100
            )
            assert got == blocks and misses == {"nope": 404, "bad/key": 400}
            status, doc = await _post(session, base, token, "/v1/xfer/read", {"agent": agent.name, "keys": ["nope"]})
            assert (
                Spec.load().problems("POST", "/v1/xfer/read", status, "application/json", json.dumps(doc).encode())
                == []
            )
            assert (await _post(session, base, token, "/v1/xfer/release", {"lease": doc["lease"]}))[0] == 204
            assert (await _post(session, base, token, "/v1/xfer/release", {"lease": lease}))[0] == 204
    async with session.get(base + "/v1/admin/status", headers=_auth(ADMIN)) as r:
        status = await r.json()
    assert Spec.load().problems("GET", "/v1/admin/status", 200, "application/json", json.dumps(status).encode()) == []
    assert status["role"] in ("single", "writer") and status["nixl"]["enabled"] is True
    assert status["nixl"]["leases"] == 0
    assert status["nixl"]["memory"]["segment_regions"] >= 1
    assert status["rdma"]["devices"] == [] and status["rdma"]["reason"]  # no RDMA NIC here


async def test_writes_over_nixl_read_back_over_http(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    _start(daemon, workers=2)  # the write is relayed to the writer, whose agent READs it
    base = daemon.base
    for policy in ("direct", "sealed"):
        token = await _tenant(session, base, f"w{policy}", policy)
        blocks = _blocks(f"w{policy}", 5)
        async with AsyncClient(base, token, transport="nixl", timeout=10) as c:
            # An empty block is refused (blocks are 1 byte or more), the others stored.
            assert await c.put_many([*blocks.items(), ("empty", b"")]) == [True] * len(blocks) + [False]
            nixl = c._nixl.agent()
            status, doc = await _post(
                session,
                base,
                token,
                "/v1/xfer/write",
                {"agent": nixl.name, "blocks": [{"key": "x", "addr": 0, "len": 0, "dev": 0}]},
            )
            assert (
                Spec.load().problems("POST", "/v1/xfer/write", status, "application/json", json.dumps(doc).encode())
                == []
            )
            assert c.stats["nixl_writes"] == len(blocks) + 1 and c.stats["nixl_fallbacks"] == 0
            # First write wins: the same key again is not replaced.
            assert await c.put_many([("wdirect0" if policy == "direct" else "wsealed0", b"other")]) == [True]
        for k, v in blocks.items():
            async with session.get(f"{base}/v1/blocks/{k}", headers=_auth(token)) as r:
                assert r.status == 200 and await r.read() == v, k
        # And the reverse: put over HTTP (above), read over NIXL.
        async with AsyncClient(base, token, transport="nixl", timeout=10) as c:
            assert await c.get_many(list(blocks)) == list(blocks.values())
    # The direct tenant's blocks landed in the room a write plan reserved in
    # their segment (no staging, no put); the sealed tenant's went through staging.
    want = sum(len(v) for v in _blocks("wdirect", 5).values())
    landed: dict[str, float] = {}
    for _ in range(50):  # /metrics merges the workers' figures, which may lag a moment
        async with session.get(f"{base}/metrics") as r:
            text = await r.text()
        landed = {
            line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvstore_nixl_bytes_total{") and 'op="write"' in line
        }
        if landed.get('op="write",source="segment"', 0) >= want and landed.get('op="write",source="staging"', 0):
            break
        await asyncio.sleep(0.1)
    assert landed.get('op="write",source="segment"', 0) >= want, landed
    assert landed.get('op="write",source="staging"', 0) > 0, landed


async def test_lease_holds_a_compacted_segment_and_ends(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    _start(daemon, nixl_lease_s="2")
    base = daemon.base
    token = await _tenant(session, base, "c", "direct")
    other = await _tenant(session, base, "o", "direct")
    blocks = _blocks("c", 10)
    await _put(session, base, token, blocks)
    agent = NixlAgent(devices="lo")
    try:
        async with aiohttp.ClientSession(base, headers=_auth(token)) as ts:
            daemon_name, doc = await agent._call(ts, base, "/v1/xfer/read", {"agent": agent.name, "keys": ["c0"]})
            b = doc["blocks"][0]
            agent.agent.add_remote_agent(base64.b64decode(doc["metadata"]))
            # Another tenant can neither use nor take this agent's name, nor release the lease.
            status, err = await _post(session, base, other, "/v1/xfer/read", {"agent": agent.name, "keys": ["c0"]})
            assert (status, err["error"]["code"]) == (409, "agent_unknown")
            meta = base64.b64encode(agent.agent.get_agent_metadata()).decode()
            status, err = await _post(session, base, other, "/v1/xfer/agents", {"name": agent.name, "metadata": meta})
            assert (status, err["error"]["code"]) == (409, "agent_taken")
            status, err = await _post(session, base, other, "/v1/xfer/release", {"lease": doc["lease"]})
            assert (status, err["error"]["code"]) == (404, "lease_not_found")
            # Delete every block of the segment and compact: the lease keeps it.
            for k in blocks:
                async with session.delete(f"{base}/v1/blocks/{k}", headers=_auth(token)) as r:
                    assert r.status == 204
            report = await _admin(session, base, "POST", "/v1/admin/compact")
            assert isinstance(report, dict)
            buf = bytearray(b["len"])
            addr = _addr(buf)
            agent._register(buf, addr, len(buf), "DRAM", 0)
            await agent._transfer(
                "READ", daemon_name, [(addr, b["len"], 0)], [(b["addr"], b["len"], 0)], "DRAM", time.monotonic() + 10
            )
            assert bytes(buf) == blocks["c0"]
            assert (await _post(session, base, token, "/v1/xfer/release", {"lease": doc["lease"]}))[0] == 204
            # A lease not released expires: its release then says so (the client discards what it read).
            _, doc2 = await agent._call(ts, base, "/v1/xfer/read", {"agent": agent.name, "keys": ["zz"]})
            await asyncio.sleep(3.2)
            status, err = await _post(session, base, token, "/v1/xfer/release", {"lease": doc2["lease"]})
            assert (status, err["error"]["code"]) == (404, "lease_not_found")
        report = await _admin(session, base, "POST", "/v1/admin/compact")
        async with session.get(base + "/v1/admin/status", headers=_auth(ADMIN)) as r:
            nixl = (await r.json())["nixl"]
        assert nixl["leases"] == 0
    finally:
        agent.close()


async def test_a_client_that_never_releases_lets_its_memory_go(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    """A client killed mid-transfer: its lease expires and the staging memory
    of its sealed blocks is freed."""
    _start(daemon, nixl_lease_s="1")
    base = daemon.base
    token = await _tenant(session, base, "k", "sealed")
    await _put(session, base, token, _blocks("k", 3))
    agent = NixlAgent(devices="lo")
    try:
        async with aiohttp.ClientSession(base, headers=_auth(token)) as ts:
            _, doc = await agent._call(ts, base, "/v1/xfer/read", {"agent": agent.name, "keys": ["k0", "k1", "k2"]})
            assert [b["status"] for b in doc["blocks"]] == [200] * 3
        async with session.get(base + "/v1/admin/status", headers=_auth(ADMIN)) as r:
            before = (await r.json())["nixl"]
        assert before["leases"] == 1 and before["staged_bytes"] >= 3 * BLOCK
        assert (await _no_leases(session, base))["leases"] == 0
    finally:
        agent.close()


async def test_the_daemon_killed_mid_transfer_is_an_error_in_time(
    daemon: Daemon, session: aiohttp.ClientSession
) -> None:
    _start(daemon)
    base = daemon.base
    token = await _tenant(session, base, "f", "direct")
    await _put(session, base, token, _blocks("f", 2))
    agent = NixlAgent(devices="lo")
    try:
        async with aiohttp.ClientSession(base, headers=_auth(token)) as ts:
            daemon_name, doc = await agent._call(ts, base, "/v1/xfer/read", {"agent": agent.name, "keys": ["f0"]})
        agent.agent.add_remote_agent(base64.b64decode(doc["metadata"]))
        b = doc["blocks"][0]
        daemon.stop(signal.SIGKILL)
        buf = bytearray(b["len"])
        addr = _addr(buf)
        agent._register(buf, addr, len(buf), "DRAM", 0)
        t0 = time.monotonic()
        with pytest.raises(NixlFallback):
            await agent._transfer(
                "READ", daemon_name, [(addr, b["len"], 0)], [(b["addr"], b["len"], 0)], "DRAM", time.monotonic() + 3
            )
        assert time.monotonic() - t0 < 5
    finally:
        agent.close()
    # The client library: no NIXL, no HTTP: a miss (not strict), within its deadline, never wrong bytes.
    async with AsyncClient(base, token, transport="nixl", timeout=2, retries=0) as c:
        buf = bytearray(BLOCK)
        t0 = time.monotonic()
        assert await c.get_into("f0", buf) is None
        assert time.monotonic() - t0 < 10 and c.stats["nixl_fallbacks"] == 1


async def _nixl_status(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(base + "/v1/admin/status", headers=_auth(ADMIN)) as r:
        doc = await r.json()
    return dict(doc["nixl"])


async def _no_leases(session: aiohttp.ClientSession, base: str, timeout: float = 10) -> dict[str, Any]:
    """The agent's status once it holds no lease (or when ``timeout`` is up)."""
    deadline = time.monotonic() + timeout
    while (status := await _nixl_status(session, base))["leases"] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return status


async def test_get_many_into_takes_one_call_and_releases_on_the_next(
    daemon: Daemon, session: aiohttp.ClientSession
) -> None:
    _start(daemon, workers=2)
    base = daemon.base
    for policy in ("direct", "sealed"):
        token = await _tenant(session, base, f"m{policy}", policy)
        blocks = _blocks(f"m{policy}", 6)
        await _put(session, base, token, blocks)
        keys = [*blocks, "absent"]
        async with AsyncClient(base, token, transport="nixl", timeout=10) as c:
            before = await _nixl_status(session, base)
            bufs = [bytearray(BLOCK + 20) for _ in keys]
            assert await c.get_many_into(keys, bufs) == [len(v) for v in blocks.values()] + [None]
            assert [bytes(b[: len(v)]) for b, v in zip(bufs, blocks.values(), strict=False)] == list(blocks.values())
            after = await _nixl_status(session, base)
            assert after["reads"] == before["reads"] + 1  # one control call for the batch
            assert after["leases"] == 1  # released with the next read, or shortly
            assert c.stats["nixl_reads"] == len(keys) and c.stats["nixl_fallbacks"] == 0
            # The next read carries the release; nothing is left held once it is done.
            assert await c.get_into(f"m{policy}0", bufs[0]) == BLOCK
            assert (await _nixl_status(session, base))["leases"] == 1
            # A buffer too small for its block: an error in strict mode, the batch's other keys still served.
            small = [bytearray(BLOCK + 20), bytearray(10)]
            assert await c.get_many_into([f"m{policy}1", f"m{policy}2"], small) == [BLOCK + 1, None]
            assert bytes(small[0][: BLOCK + 1]) == blocks[f"m{policy}1"]
            with pytest.raises(ValueError):
                await c.get_many_into(["a", "b"], [bytearray(1)])
        assert (await _no_leases(session, base, 5))["leases"] == 0  # close() released the last
        source = "mapping" if policy == "direct" else "staging"
        await asyncio.sleep(0.6)  # one snapshot interval: /metrics covers both workers
        async with session.get(base + "/metrics") as r:
            text = await r.text()
        assert f'kvstore_nixl_bytes_total{{op="read",source="{source}"}}' in text, text[-2000:]
    # More buffers in one batch than the client keeps registered: none is let go while the READ needs it.
    token = await _tenant(session, base, "many", "direct")
    small = {f"s{i}": random.Random(i).randbytes(1000 + i) for i in range(MAX_REGISTERED + 44)}
    async with AsyncClient(base, token, timeout=30) as c:
        assert all(await c.put_many(small.items()))
    async with AsyncClient(base, token, transport="nixl", timeout=30, strict=True) as c:
        bufs = [bytearray(len(v)) for v in small.values()]
        assert await c.get_many_into(list(small), bufs) == [len(v) for v in small.values()]
        assert bufs == list(small.values()) and c.stats["nixl_fallbacks"] == 0
        agent = c._nixl.agent()
        assert len(agent._regs) == MAX_REGISTERED and not agent._pinned
    # Batched releases: every lease ends; unknown ones are ignored.
    token = await _tenant(session, base, "r", "direct")
    await _put(session, base, token, _blocks("r", 2))
    agent = NixlAgent(devices="lo")
    try:
        async with aiohttp.ClientSession(base, headers=_auth(token)) as ts:
            leases = [
                (await agent._call(ts, base, "/v1/xfer/read", {"agent": agent.name, "keys": [k]}))[1]["lease"]
                for k in ("r0", "r1")
            ]
        assert (await _nixl_status(session, base))["leases"] == 2
        status, _ = await _post(session, base, token, "/v1/xfer/release", {"leases": [*leases, "unknown"]})
        assert status == 204 and (await _nixl_status(session, base))["leases"] == 0
    finally:
        agent.close()


async def test_get_prefix_over_nixl_and_a_deadline_that_cuts_it(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    """``get_prefix`` reads over NIXL (one READ per key, eight at once) up to
    a miss, and learns the NIXL bandwidth; with the tenant at 10 requests a
    second (five at once, then one each 0.1 s: each NIXL read is a control
    call) a deadline of 0.4 s cuts it, and nothing lands in ``bufs[:n]``
    after it returns. (A read limit would not: a NIXL read's bytes are
    charged when its plan is answered, without a wait.)"""
    _start(daemon)
    base = daemon.base
    token = await _tenant(session, base, "p", "direct")
    blocks = _blocks("p", 12)
    await _put(session, base, token, blocks)
    keys = list(blocks)
    async with AsyncClient(base, token, transport="nixl", timeout=10) as c:
        bufs = [bytearray(BLOCK + 20) for _ in range(len(keys) + 2)]
        assert await c.get_prefix([*keys, "absent", keys[0]], bufs, deadline_s=30) == len(keys)
        assert [bytes(b[: len(v)]) for b, v in zip(bufs, blocks.values(), strict=False)] == list(blocks.values())
        assert c.stats["nixl_reads"] >= len(keys) and c.stats["nixl_fallbacks"] == 0
        assert c.bandwidth(base, "nixl") is not None and c.bandwidth(base, "http") is None
        # (The same client: its agent is known to the daemon already, a new one would spend the deadline on that.)
        await _admin(session, base, "PATCH", "/v1/admin/tenants/p", {"qos": {"requests_per_s": 10}})
        bufs = [bytearray(BLOCK + 20) for _ in keys]
        t0 = time.monotonic()
        n = await c.get_prefix(keys, bufs, deadline_s=0.4)
        took = time.monotonic() - t0
        at_return = [bytes(b) for b in bufs[:n]]
        await c.wait_loads()
    assert took <= 0.4 + DEADLINE_SLACK_S, took
    assert 1 <= n < len(keys), n
    for i in range(n):
        assert at_return[i] == bytes(bufs[i])  # nothing landed after the return
        assert at_return[i][: len(blocks[keys[i]])] == blocks[keys[i]]


async def test_a_slow_read_past_its_lease_fails_its_checksum_and_goes_over_http(
    daemon: Daemon, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease of a sealed block expires while the client's READ is held
    up; another read is staged in the same memory; the late READ gets those
    bytes, their checksum fails, and the client reads the block over HTTP."""
    _start(daemon, nixl_lease_s="1")
    base = daemon.base
    token = await _tenant(session, base, "slow", "sealed")
    blocks = {k: random.Random(k).randbytes(BLOCK) for k in ("a", "b")}
    await _put(session, base, token, blocks)
    async with (
        AsyncClient(base, token, transport="nixl", timeout=10) as slow,
        AsyncClient(base, token, transport="nixl", timeout=10) as quick,
    ):
        agent = slow._nixl.agent()
        real = agent._transfer
        staged: list[int] = []

        async def held_up(op: str, peer: str, local: Any, remote: Any, mem: str, deadline: float) -> None:
            staged.append(remote[0][0])
            await asyncio.sleep(3)  # the fault: past the lease (1 s) and the sweep that ends it
            await real(op, peer, local, remote, mem, deadline)

        agent._transfer = held_up  # type: ignore[method-assign]
        buf = bytearray(BLOCK)
        late = asyncio.ensure_future(slow.get_into("a", buf))
        await asyncio.sleep(2.5)
        assert (await _nixl_status(session, base))["leases"] == 0  # expired and swept
        other = bytearray(BLOCK)
        assert await quick.get_into("b", other) == BLOCK and other == blocks["b"]
        q = quick._nixl.agent()
        assert q._pending  # its release is pending: the staging memory is "b"'s until it goes
        assert await late == BLOCK
        assert buf == blocks["a"]
        assert slow.stats["nixl_fallbacks"] == 1 and slow.stats["nixl_reads"] == 0
        assert "fails its checksum" in caplog.text


async def test_a_killed_client_process_lets_its_lease_and_memory_go(
    daemon: Daemon, session: aiohttp.ClientSession, tmp_path: Any
) -> None:
    """A client process killed with transfers in flight: its lease expires,
    the staging memory it held is free again, and the daemon serves others."""
    _start(daemon, nixl_lease_s="1")
    base = daemon.base
    token = await _tenant(session, base, "kill", "sealed")
    blocks = _blocks("kill", 4)
    await _put(session, base, token, blocks)
    script = tmp_path / "client.py"
    script.write_text(
        "import asyncio, sys, time\n"
        "from kvstore_client import AsyncClient\n"
        "async def main():\n"
        f"    async with AsyncClient({base!r}, {token!r}, transport='nixl', timeout=30) as c:\n"
        "        agent = c._nixl.agent()\n"
        "        real = agent._transfer\n"
        "        async def start_and_hang(*a):\n"
        "            t = asyncio.ensure_future(real(*a))\n"
        "            print('started', flush=True)\n"
        "            await asyncio.sleep(60)\n"
        "        agent._transfer = start_and_hang\n"
        f"        await c.get_many_into({list(blocks)!r}, [bytearray({BLOCK + 10}) for _ in range(4)])\n"
        "asyncio.run(main())\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "clients"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), stdout=asyncio.subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        lines: list[bytes] = []
        while not lines or lines[-1].strip() != b"started":  # NIXL logs to stdout too
            lines.append(await asyncio.wait_for(proc.stdout.readline(), 30))
            assert lines[-1], lines
        held = await _nixl_status(session, base)
        assert held["leases"] == 1 and held["memory"]["staging_in_use"] >= 4 * BLOCK
    finally:
        proc.kill()
        await proc.wait()
    after = await _no_leases(session, base)
    assert after["leases"] == 0 and after["memory"]["staging_in_use"] == 0
    async with AsyncClient(base, token, transport="nixl", timeout=10) as c:
        bufs = [bytearray(BLOCK + 10) for _ in blocks]
        assert await c.get_many_into(list(blocks), bufs) == [len(v) for v in blocks.values()]
        assert [bytes(b[: len(v)]) for b, v in zip(bufs, blocks.values(), strict=True)] == list(blocks.values())
        assert c.stats["nixl_fallbacks"] == 0


async def test_a_daemon_without_nixl_is_read_over_http(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    daemon.extra = ["--compact-interval-s", "0"]
    daemon.start()
    base = daemon.base
    token = await _tenant(session, base, "h", "direct")
    blocks = _blocks("h", 2)
    await _put(session, base, token, blocks)
    status, err = await _post(session, base, token, "/v1/xfer/read", {"agent": "a", "keys": ["h0"]})
    assert (status, err["error"]["code"]) == (404, "nixl_disabled")
    async with AsyncClient(base, token, transport="nixl") as c:
        for k, v in blocks.items():
            buf = bytearray(len(v))
            assert await c.get_into(k, buf) == len(v) and buf == v
        assert await c.put_many([("h9", b"x" * 100)]) == [True]
        assert c.stats["nixl_fallbacks"] == 1 and c.stats["nixl_reads"] == 0  # asked once, then not again
    async with session.get(base + "/v1/admin/status", headers=_auth(ADMIN)) as r:
        doc = await r.json()
    assert doc["nixl"] == {"enabled": False} and doc["rdma"]["reason"]


async def test_bad_input_names_the_field(daemon: Daemon, session: aiohttp.ClientSession) -> None:
    _start(daemon)
    base = daemon.base
    token = await _tenant(session, base, "b", "direct")
    cases: list[tuple[str, object, str]] = [
        ("/v1/xfer/agents", {"name": "x"}, "metadata"),
        ("/v1/xfer/agents", {"name": "x", "metadata": "%%%"}, "metadata"),
        ("/v1/xfer/agents", {"name": "x", "metadata": base64.b64encode(b"not metadata").decode()}, "metadata"),
        ("/v1/xfer/agents", {"name": "", "metadata": ""}, "name"),
        ("/v1/xfer/read", {"agent": "x"}, "keys"),
        ("/v1/xfer/read", {"agent": "x", "keys": "k"}, "keys"),
        ("/v1/xfer/read", {"agent": "x", "keys": [], "extra": 1}, "extra"),
        ("/v1/xfer/read", {"agent": "x", "keys": ["k"], "checksums": 1}, "checksums"),
        ("/v1/xfer/read", {"agent": "x", "keys": ["k"], "release": "l"}, "release"),
        ("/v1/xfer/release", {"lease": 5}, "lease"),
        ("/v1/xfer/release", {"leases": [5]}, "leases"),
        ("/v1/xfer/release", {"leases": [], "lease": "l"}, "lease"),
        ("/v1/xfer/write", {"agent": "x", "blocks": []}, "blocks"),
        ("/v1/xfer/write", {"agent": "x", "blocks": [{"key": "k", "addr": -1, "len": 1, "dev": 0}]}, "addr"),
        ("/v1/xfer/write", {"agent": "x", "blocks": [{"key": "k", "addr": 1, "len": 1 << 40, "dev": 0}]}, "len"),
        ("/v1/xfer/write", {"agent": "x", "blocks": [{"key": "a/b", "addr": 1, "len": 1, "dev": 0}]}, "key"),
    ]
    for path, body, field in cases:
        status, err = await _post(session, base, token, path, body)
        assert status == 400 and field in err["error"]["message"], (path, body, err)
    # A write naming memory the agent never registered fails as a transfer, and stores nothing.
    agent = NixlAgent(devices="lo")
    try:
        async with aiohttp.ClientSession(base, headers=_auth(token)) as ts:
            await agent._daemon(ts, base)
        doc = {"agent": agent.name, "blocks": [{"key": "k", "addr": 4096, "len": 100, "dev": 0}]}
        status, err = await _post(session, base, token, "/v1/xfer/write", doc)
        assert status in (400, 502) and err["error"]["code"] in ("transfer_failed", "invalid_input")
        async with session.get(f"{base}/v1/blocks/k", headers=_auth(token)) as r:
            assert r.status == 404
    finally:
        agent.close()


@pytest.fixture(autouse=True)
def _no_leftover_env() -> Iterator[None]:
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    yield
    for k in [k for k in os.environ if k.startswith("UCX_") and k not in before]:
        del os.environ[k]


def test_engine_adapters_choose_the_transport() -> None:
    from kvstore_client.adapters._common import CLIENT_SETTINGS, Settings

    settings = {"endpoints": "http://127.0.0.1:1", "transport": "nixl", "nixl_devices": "lo"}
    client = Settings(settings, "test", CLIENT_SETTINGS).client()
    assert client.transport == "nixl" and client._nixl.options == (None, "lo")
    assert Settings({"endpoints": "http://127.0.0.1:1"}, "test", CLIENT_SETTINGS).client().transport == "http"
    with pytest.raises(ValueError, match="transport='rdma'"):
        Settings({**settings, "transport": "rdma"}, "test", CLIENT_SETTINGS).client()

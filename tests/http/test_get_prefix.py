"""``get_prefix``: the leading blocks of a prefix loaded against a deadline
(issue 29's client part), on HTTP and on unix read plans; a deadline that
cuts a load in the middle (the tenant's QoS read limit makes it slow), a miss
in the middle, a daemon that never answers; the bandwidth the client learns.

No byte may land in ``bufs[:n]`` after ``get_prefix`` returns: each test
keeps a copy of ``bufs[:n]`` at return, waits for the reads left running
(``wait_loads``), and compares."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from kvstore_client import AsyncClient, Client
from kvstore_client.prefix import DEADLINE_SLACK_S

from tests.http.conftest import ADMIN, Api, Daemon

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 256 * KiB


async def _fill(api: Api, token: str, n: int, prefix: str = "k") -> dict[str, bytes]:
    blocks = {f"{prefix}{i}": os.urandom(BLOCK - i) for i in range(n)}
    for k, v in blocks.items():
        async with api.session.put(api.url(f"/v1/blocks/{k}"), data=io.BytesIO(v), headers=api.auth(token)) as r:
            assert r.status == 201
    return blocks


async def test_a_whole_prefix_loads_and_the_client_learns_its_bandwidth(api: Api) -> None:
    token = await api.tenant("t", "direct")
    blocks = await _fill(api, token, 10)
    keys = list(blocks)
    bufs = [bytearray(BLOCK) for _ in keys]
    async with AsyncClient(api.base, token) as kv:
        assert kv.bandwidth() is None
        assert await kv.get_prefix(keys, bufs, deadline_s=30) == len(keys)
        for k, b in zip(keys, bufs, strict=True):
            assert bytes(b[: len(blocks[k])]) == blocks[k]
        rate = kv.bandwidth(api.base, "http")
        assert rate is not None and rate > 0
        assert kv.bandwidth() == rate and kv.bandwidth(transport="unix") is None
        assert await kv.get_prefix([], [], 1) == 0


async def test_a_miss_in_the_middle_ends_the_prefix(api: Api) -> None:
    token = await api.tenant("t", "sealed")
    blocks = await _fill(api, token, 9)
    keys = list(blocks)
    keys[5] = "absent"
    bufs = [bytearray(BLOCK) for _ in keys]
    async with AsyncClient(api.base, token) as kv:
        assert await kv.get_prefix(keys, bufs, deadline_s=30) == 5
        await kv.wait_loads()
    for k, b in zip(keys[:5], bufs, strict=False):
        assert bytes(b[: len(blocks[k])]) == blocks[k]


@pytest.mark.parametrize("window", [0.3, 0.9])
async def test_a_deadline_cuts_a_slow_load_and_nothing_lands_in_the_prefix_after(api: Api, window: float) -> None:
    """1 MiB/s of reads (its QoS limit): half a MiB at once, then a block of
    256 KiB each quarter second; a deadline in the middle."""
    token = await api.tenant("slow", "direct", qos={"read_bytes_per_s": 1 * MiB})
    blocks = await _fill(api, token, 12)
    keys = list(blocks)
    bufs = [bytearray(BLOCK) for _ in keys]
    async with AsyncClient(api.base, token, timeout=5) as kv:
        t0 = time.monotonic()
        n = await kv.get_prefix(keys, bufs, deadline_s=window)
        took = time.monotonic() - t0
        at_return = [bytes(b) for b in bufs[:n]]
        await kv.wait_loads()
    assert took <= window + DEADLINE_SLACK_S, took
    assert 1 <= n < len(keys), n
    for i in range(n):
        assert at_return[i] == bytes(bufs[i])  # nothing landed after the return
        assert at_return[i][: len(blocks[keys[i]])] == blocks[keys[i]]


async def test_a_daemon_that_never_answers_costs_the_deadline_and_raises_nothing(tmp_path: Path) -> None:
    with socket.socket() as listener:  # accepts connections (the kernel's backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        bufs = [bytearray(BLOCK) for _ in range(4)]
        for strict in (False, True):
            async with AsyncClient(base, "kvs_x", timeout=1.0, retries=0, strict=strict) as kv:
                t0 = time.monotonic()
                assert await kv.get_prefix([f"k{i}" for i in range(4)], bufs, deadline_s=0.3) == 0
                assert time.monotonic() - t0 <= 0.3 + DEADLINE_SLACK_S
                await kv.wait_loads()  # the reads end with the client's timeout


def test_the_sync_client_and_bad_arguments(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        kv = Client(f"http://127.0.0.1:{listener.getsockname()[1]}", "kvs_x", timeout=0.5, retries=0)
        try:
            assert kv.get_prefix(["a"], [bytearray(8)], 0.1) == 0
            kv.wait_loads()
            assert kv.bandwidth() is None
            with pytest.raises(ValueError, match="2 keys but 1 buffers"):
                kv.get_prefix(["a", "b"], [bytearray(8)], 1)
            with pytest.raises(ValueError, match="deadline_s"):
                kv.get_prefix(["a"], [bytearray(8)], -1)
        finally:
            kv.close()


async def test_unix_read_plans_serve_it(daemon: Daemon, sock_dir: Path) -> None:
    sock = str(sock_dir / "kv.sock")
    daemon.extra = ["--listen", f"unix:{sock}", "--unix-socket-mode", "0666"]
    daemon.start()
    async with aiohttp.ClientSession() as s:
        async with s.post(
            daemon.base + "/v1/admin/tenants",
            json={"name": "d", "policy": "direct"},
            headers={"Authorization": f"Bearer {ADMIN}"},
        ) as r:
            token = (await r.json())["token"]
        blocks = {f"k{i}": os.urandom(BLOCK - i) for i in range(16)}
        for k, v in blocks.items():
            async with s.put(
                f"{daemon.base}/v1/blocks/{k}", data=io.BytesIO(v), headers={"Authorization": f"Bearer {token}"}
            ) as r:
                assert r.status == 201
    keys = [*blocks, "absent"]
    bufs = [bytearray(BLOCK) for _ in keys]
    async with AsyncClient(f"unix:{sock}", token) as kv:
        assert await kv.get_prefix(keys, bufs, deadline_s=30) == 16
        for k, b in zip(keys, bufs, strict=False):
            if k in blocks:
                assert bytes(b[: len(blocks[k])]) == blocks[k]
        assert kv.bandwidth(f"unix:{sock}", "unix") is not None
        assert await kv.get_prefix(keys, bufs, deadline_s=0) == 0  # no time at all: nothing counted
        await kv.wait_loads()
    _ = asyncio  # (the tests' loop is pytest-asyncio's)


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
async def test_a_daemon_that_stalls_or_dies_mid_load_ends_the_prefix(daemon: Daemon, fault: str) -> None:
    """A load throttled to 1 MiB/s (two blocks at once, then one each quarter
    second) and, 0.3 s in, the daemon stopped (SIGSTOP: the deadline ends the
    call) or killed (SIGKILL: the reads fail at once, long before the
    deadline). ``n`` counts only what arrived, and nothing lands in
    ``bufs[:n]`` after the return."""
    daemon.start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    admin = {"Authorization": f"Bearer {ADMIN}"}
    blocks = {f"k{i}": os.urandom(BLOCK - i) for i in range(12)}
    async with aiohttp.ClientSession() as s:
        doc = {"name": "t", "policy": "direct", "qos": {"read_bytes_per_s": MiB}}
        async with s.post(daemon.base + "/v1/admin/tenants", json=doc, headers=admin) as r:
            token = (await r.json())["token"]
        for k, v in blocks.items():
            url, auth = f"{daemon.base}/v1/blocks/{k}", {"Authorization": f"Bearer {token}"}
            async with s.put(url, data=io.BytesIO(v), headers=auth) as r:
                assert r.status == 201
    keys = list(blocks)
    bufs = [bytearray(BLOCK) for _ in keys]
    deadline = 1.0 if fault == "SIGSTOP" else 30.0
    try:
        async with AsyncClient(daemon.base, token, timeout=5, retries=0) as kv:
            t0 = time.monotonic()
            task = asyncio.create_task(kv.get_prefix(keys, bufs, deadline_s=deadline))
            await asyncio.sleep(0.3)
            os.kill(pid, getattr(signal, fault))
            n = await task
            took = time.monotonic() - t0
            at_return = [bytes(b) for b in bufs[:n]]
            if fault == "SIGSTOP":
                os.kill(pid, signal.SIGCONT)
            await kv.wait_loads()
    finally:
        if fault == "SIGSTOP":
            os.kill(pid, signal.SIGCONT)
    assert 1 <= n < len(keys), n
    if fault == "SIGSTOP":
        assert deadline - 0.1 <= took <= deadline + DEADLINE_SLACK_S, took
    else:
        assert took < 3.0, took  # the failed reads end the prefix, not the deadline
    for i in range(n):
        assert at_return[i] == bytes(bufs[i])
        assert at_return[i][: len(blocks[keys[i]])] == blocks[keys[i]]


async def test_the_client_reads_its_tenants_read_limit(api: Api) -> None:
    limited = await api.tenant("lim", "direct", qos={"read_bytes_per_s": 5 * MiB})
    free = await api.tenant("free", "direct")
    async with AsyncClient(api.base, limited) as kv:
        assert await kv.read_limit() == 5 * MiB
    async with AsyncClient(api.base, free) as kv:
        assert await kv.read_limit() is None

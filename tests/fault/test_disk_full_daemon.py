"""server.py on a real small filesystem (a tmpfs the test mounts), 1 and 2
workers, filled through the API by two tenants (direct and sealed) from four
connections, then to the last byte by another process: every refusal is a
JSON ``507 storage_full`` that says what is full, every acknowledged block
reads back, every DELETE succeeds, puts resume by themselves once the
deletes' space is reclaimed, ``/metrics`` shows the full disk, and a
restart while full serves everything and still deletes.

Regression (issue 24, item 1): the same run answered DELETE ``507`` for 45
of 62 blocks, ``POST /v1/admin/compact`` reported "no space left on device"
and reclaimed nothing, and puts stayed ``507`` until an operator stopped the
daemon and deleted files by hand.
"""

from __future__ import annotations

import asyncio
import io
import random
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from kvstore.transport.http.metrics import SNAPSHOT_S
from tests.fault.smallfs import MiB, fill, mount_tmpfs, unmount
from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port
from tests.http.test_daemon import _ready

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
Blocks = dict[tuple[str, str], bytes]


async def _tenant(session: aiohttp.ClientSession, base: str, name: str, policy: str) -> dict[str, str]:
    async with session.post(base + "/v1/admin/tenants", json={"name": name, "policy": policy}, headers=ADMIN_H) as r:
        assert r.status == 201, await r.text()
        return {"Authorization": f"Bearer {(await r.json())['token']}"}


async def _fill(session: aiohttp.ClientSession, base: str, auth: dict[str, dict[str, str]]) -> Blocks:
    """Four writers, 0.1-1.5 MB blocks, until each was refused a few times."""
    acked: Blocks = {}

    async def writer(n: int) -> None:
        rng = random.Random(n)
        refused = 0
        i = 0
        while refused < 4:
            tenant = ("direct", "sealed")[(n + i) % 2]
            key, data = f"w{n}-{i:04d}", rng.randbytes(rng.randint(100_000, 1_500_000))
            i += 1
            async with session.put(f"{base}/v1/blocks/{key}", data=io.BytesIO(data), headers=auth[tenant]) as r:
                if r.status == 507:
                    err = (await r.json())["error"]
                    assert err["code"] == "storage_full", err
                    assert "full" in err["message"] or "no space left" in err["message"], err
                    refused += 1
                    continue
                assert r.status == 201, await r.text()
            acked[(tenant, key)] = data

    await asyncio.gather(*(writer(n) for n in range(4)))
    return acked


async def _check(session: aiohttp.ClientSession, base: str, auth: dict[str, dict[str, str]], acked: Blocks) -> None:
    for (tenant, key), data in acked.items():
        async with session.get(f"{base}/v1/blocks/{key}", headers=auth[tenant]) as r:
            assert r.status == 200, f"{tenant}/{key}: {r.status} {await r.text()}"
            assert await r.read() == data, f"{tenant}/{key}"


async def _delete_half(
    session: aiohttp.ClientSession, base: str, auth: dict[str, dict[str, str]], acked: Blocks, start: int
) -> None:
    for tenant, key in list(acked)[start::2]:
        async with session.delete(f"{base}/v1/blocks/{key}", headers=auth[tenant]) as r:
            assert r.status == 204, f"DELETE {tenant}/{key} on a full disk: {r.status} {await r.text()}"
        del acked[(tenant, key)]


async def _puts_resume(session: aiohttp.ClientSession, base: str, auth: dict[str, str], timeout: float = 60) -> float:
    t0 = time.monotonic()
    while True:
        key = f"after-{time.monotonic_ns()}"
        async with session.put(f"{base}/v1/blocks/{key}", data=b"x" * (256 << 10), headers=auth) as r:
            if r.status == 201:
                return time.monotonic() - t0
            assert r.status == 507, await r.text()
        assert time.monotonic() - t0 < timeout, "puts never resumed after the deletes"
        await asyncio.sleep(0.25)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_full_disk_is_freed_through_the_api(tmp_path: Path, workers: int) -> None:
    fs = tmp_path / "fs"
    mount_tmpfs(fs, 64 * MiB)
    env = daemon_env(tmp_path, frame_size="64KiB", compact_interval_s="0")
    daemon = Daemon(fs / "data", free_port(), env, extra=["--workers", str(workers)], log_dir=tmp_path)
    try:
        daemon.start()
        async with aiohttp.ClientSession() as session:
            await _ready(daemon.base, session)
            auth = {p: await _tenant(session, daemon.base, p, p) for p in ("direct", "sealed")}
            acked = await _fill(session, daemon.base, auth)
            assert len(acked) > 20
            await _check(session, daemon.base, auth, acked)
            fill(fs / "other-process")

            await _delete_half(session, daemon.base, auth, acked, 0)
            waited = await _puts_resume(session, daemon.base, auth["direct"])
            await _check(session, daemon.base, auth, acked)
            async with session.post(daemon.base + "/v1/admin/compact", headers=ADMIN_H) as r:
                assert r.status == 200 and (await r.json())["errors"] == []
            # With several workers a scrape may land on a reader, whose copy of the
            # writer's counters is up to SNAPSHOT_S old: look until it has the compaction.
            t0 = time.monotonic()
            while True:
                async with session.get(daemon.base + "/metrics") as r:
                    text = await r.text()
                lines = text.splitlines()
                reclaimed = [ln for ln in lines if ln.startswith("kvstore_compaction_bytes_reclaimed_total")]
                if (reclaimed and float(reclaimed[0].split()[-1]) > 0) or time.monotonic() - t0 > 10 * SNAPSHOT_S:
                    break
                await asyncio.sleep(SNAPSHOT_S / 2)
            assert reclaimed and float(reclaimed[0].split()[-1]) > 0, reclaimed
            assert "kvstore_space_full" in text and "kvstore_space_reserve_bytes" in text
            assert "kvstore_space_reserve_releases" in text

            fill(fs / "other-process-2")  # full again, to the last byte; then a restart while full
        assert daemon.stop() == 0
        daemon.start()
        async with aiohttp.ClientSession() as session:
            await _ready(daemon.base, session)
            await _check(session, daemon.base, auth, acked)
            await _delete_half(session, daemon.base, auth, acked, 1)
            await _puts_resume(session, daemon.base, auth["sealed"])
            await _check(session, daemon.base, auth, acked)
        assert daemon.stop() == 0
        assert "Traceback" not in daemon.output, daemon.output[-4000:]
        print(f"{workers} workers: puts resumed {waited:.2f} s after the last delete")
    finally:
        if daemon.proc is not None:
            daemon.stop(signal.SIGKILL)
        unmount(fs)

"""One /metrics for the whole daemon: with two workers sharing the port,
every scrape, whichever worker answers it, counts the requests both
served."""

from __future__ import annotations

import asyncio
import re

import aiohttp

from .conftest import Daemon
from .test_read_plans import _tenant


def _value(text: str, series: str) -> float:
    m = re.search("^" + re.escape(series) + r" (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{series} not in the exposition"
    return float(m.group(1))


async def test_one_exposition_counts_every_worker(daemon: Daemon) -> None:
    daemon.extra = ["--workers", "2"]
    daemon.start()
    base = daemon.base
    fresh = aiohttp.TCPConnector(force_close=True)  # a new connection each time: the kernel spreads them
    async with aiohttp.ClientSession(connector=fresh) as s:
        token = await _tenant(s, base, "m", "direct")
        pids = set()
        for _ in range(40):
            async with s.get(f"{base}/healthz") as r:
                pids.add((await r.json())["pid"])
        assert len(pids) == 2, "both workers take connections"
        for _ in range(40):
            async with s.get(f"{base}/v1/stats", headers={"Authorization": f"Bearer {token}"}) as r:
                assert r.status == 200
        await asyncio.sleep(1.2)  # past one snapshot interval of each worker
        series = 'kvstore_http_requests_total{method="GET",route="/v1/stats",status="200"}'
        for _ in range(8):
            async with s.get(f"{base}/metrics") as r:
                text = await r.text()
            assert _value(text, "kvstore_workers") == 2
            assert _value(text, series) == 40
            assert text.count("# TYPE kvstore_http_requests_total counter") == 1

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


async def test_hit_rate_in_blocks_and_tokens(daemon: Daemon) -> None:
    daemon.start()
    base = daemon.base
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, base, "h", "direct")
        auth = {"Authorization": f"Bearer {token}"}
        for k in ("c0", "c1"):
            async with s.put(f"{base}/v1/blocks/{k}", data=b"x", headers=auth) as r:
                assert r.status == 201
        chain = {"keys": ["c0", "c1", "c2", "c3"], "tokens_per_block": 16}
        async with s.post(f"{base}/v1/lookup", json=chain, headers=auth) as r:
            assert r.status == 200 and (await r.json())["prefix"] == 2
        async with s.post(f"{base}/v1/lookup", json={"keys": ["c0", "zz"]}, headers=auth) as r:
            assert r.status == 200  # no tokens_per_block: counted in blocks only
        for bad in (0, "16", True, 1 << 21):
            async with s.post(f"{base}/v1/lookup", json={"keys": ["c0"], "tokens_per_block": bad}, headers=auth) as r:
                assert r.status == 400 and "tokens_per_block" in (await r.json())["error"]["message"]
        async with s.get(f"{base}/metrics") as r:
            text = await r.text()
    assert _value(text, "kvstore_prefix_lookups_total") == 2
    assert _value(text, 'kvstore_prefix_blocks_total{result="hit"}') == 3
    assert _value(text, 'kvstore_prefix_blocks_total{result="miss"}') == 3
    assert _value(text, 'kvstore_prefix_tokens_total{result="hit"}') == 32
    assert _value(text, 'kvstore_prefix_tokens_total{result="miss"}') == 32

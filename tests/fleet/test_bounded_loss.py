"""What a node's death costs is bounded in time (issue 40): three daemons on
moto's S3 server. With ``seal_after_s``, blocks acknowledged more than
``seal_after_s`` plus an upload before their node is killed with SIGKILL
are all read back through the survivors, without anyone calling
``/v1/admin/flush``; a node stopped with SIGTERM seals and uploads its open
segments before it exits, so the survivors serve its blocks too, with
``seal_after_s`` off."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import boto3

from ..http.conftest import Daemon
from ..moto_s3 import REGION, S3Env
from .test_daemons import DEAD_AFTER_S, Fleet, call, until

SEAL_AFTER_S = 1.0
UPLOAD_MARGIN_S = 5.0  # a few small segments to moto on 127.0.0.1, on a loaded 2-core machine


def metric(d: Daemon, name: str, labels: str = "") -> float:
    """A series of ``d``'s /metrics (0 when it has none yet)."""
    text = call(d.base, "GET", "/metrics").body
    text = text.decode() if isinstance(text, bytes) else str(text)
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def segment_objects(s3: S3Env, prefix: str, node_id: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=s3.url, region_name=REGION)
    try:
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=s3.bucket, Prefix=f"{prefix}/nodes/{node_id}/segments/"
        )
        return [obj["Key"] for page in pages for obj in page.get("Contents", ())]
    finally:
        client.close()


async def _write_then_lose_node_1(f: Fleet, sig: int, *, wait_for_seal: bool) -> tuple[list[str], float | None]:
    """Blocks through a fleet client; node-1's (by rendezvous hashing) then
    lost with ``sig``; every one of them read back through the survivors.
    Returns node-1's keys and, with ``wait_for_seal``, the seconds from the
    last ack until node-1 had sealed and uploaded them."""
    from kvstore_client import AsyncClient
    from kvstore_client.sharding import rank_endpoints

    n0, n1, n2 = f.nodes
    token = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "t", "policy": "sealed"}).body["token"]
    f.wait_token(token)
    urls = sorted(d.base for d in f.nodes)
    blocks = {f"blk-{i:03d}": os.urandom(3000 + i) for i in range(60)}
    theirs = [k for k in blocks if rank_endpoints(urls, k)[0] == n1.base]
    assert len(theirs) >= 5
    async with AsyncClient(n0.base, token, fleet=True, fleet_refresh_s=0.5, timeout=5, retries=1) as kv:
        assert all(await kv.put_many(blocks.items()))
        acked = time.monotonic()
        took = None
        if wait_for_seal:
            # No flush: within seal_after_s + an upload, node-1 has sealed what
            # it holds (a seal by age counted, nothing unsealed left) and the
            # mirror has nothing waiting.
            until(
                "node-1 sealed and uploaded its blocks by age",
                lambda: (
                    metric(n1, "kvstore_segments_sealed_early_total", '{reason="age"}') >= 1
                    and metric(n1, "kvstore_unsealed_oldest_seconds") == 0
                    and metric(n1, "kvstore_tier_upload_backlog_segments") == 0
                ),
                SEAL_AFTER_S + UPLOAD_MARGIN_S,
            )
            took = time.monotonic() - acked
            assert took >= SEAL_AFTER_S - 0.3, f"sealed {took:.2f} s after the ack, before seal_after_s"
        n1.stop(sig)
        until("node-1 declared dead", lambda: f.member(n0, "node-1")["state"] == "dead", 4 * DEAD_AFTER_S)
        t0 = time.monotonic()
        while kv.endpoints != sorted([n0.base, n2.base]):
            assert time.monotonic() - t0 < 10
            await kv.exists("probe")
            await asyncio.sleep(0.1)
        t0 = time.monotonic()
        while await kv.get_many(theirs) != [blocks[k] for k in theirs]:
            assert time.monotonic() - t0 < 20, "the survivors did not serve node-1's blocks"
            await asyncio.sleep(0.2)
        for k in theirs:
            assert await kv.get(k) == blocks[k]
    return theirs, took


async def test_blocks_acked_seal_after_s_before_a_sigkill_are_served_by_the_survivors(
    tmp_path: Path, s3: S3Env
) -> None:
    f = Fleet(tmp_path, s3, 3, seal_after_s=str(SEAL_AFTER_S))
    try:
        f.start()
        theirs, took = await _write_then_lose_node_1(f, signal.SIGKILL, wait_for_seal=True)
        print(
            f"node-1's {len(theirs)} blocks sealed and in the bucket {took:.2f} s after the ack "
            f"(seal_after_s = {SEAL_AFTER_S}); all read back through the survivors after SIGKILL"
        )
        assert segment_objects(s3, f.prefix, "node-1")
    finally:
        f.stop()


async def test_a_node_stopped_with_sigterm_seals_and_uploads_before_it_exits(tmp_path: Path, s3: S3Env) -> None:
    f = Fleet(tmp_path, s3, 3, seal_after_s="0")  # off: only the stop seals
    try:
        f.start()
        n1 = f.nodes[1]
        await _write_then_lose_node_1(f, signal.SIGTERM, wait_for_seal=False)
        assert re.search(r"stop: sealed \d+ open segments and the object tier has every sealed segment", n1.output)
        assert segment_objects(s3, f.prefix, "node-1")
    finally:
        f.stop()

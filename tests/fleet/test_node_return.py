"""A node's return loses nothing: a fleet client reads every block of the
fleet in a loop while one node is killed with SIGKILL and started again,
three times over (three daemons, two workers each, moto's S3): from the
moment the node is started again, no read misses.

Used to be: each time the node was back and ready, its share of the blocks
(a third here) missed for 3.5 to 4 s, three returns of three. Two causes:
the survivors let go of its blocks as soon as they saw it alive, while
clients placed its keys on them by the membership they had read before;
and a client's circuit breaker for the node, opened while it was away, made
every call to it fail at once until the breaker's cooldown (5 s) passed,
though the node served again. Now survivors serve a returned node's blocks
beside it for ``fleet_handback_s``, and a client probes a member the
membership lists alive again at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvstore_client import AsyncClient

from ..moto_s3 import S3Env
from .test_daemons import DEAD_AFTER_S, HANDBACK_S, Fleet, call, until

pytestmark = pytest.mark.slow
RETURNS = 3


@pytest.fixture
def fleet(tmp_path: Path, s3: S3Env) -> Iterator[Fleet]:
    f = Fleet(tmp_path, s3, 3)
    try:
        f.start()
        yield f
    finally:
        f.stop()


async def test_every_block_is_read_through_a_nodes_returns(fleet: Fleet) -> None:
    n0, n1, _ = fleet.nodes
    token = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "t", "policy": "sealed"}).body["token"]
    fleet.wait_token(token)
    blocks = {f"blk-{i:03d}": os.urandom(2000 + i) for i in range(90)}
    keys = list(blocks)
    async with AsyncClient(n0.base, token, fleet=True, fleet_refresh_s=0.5, timeout=5, retries=1) as kv:
        assert all(await kv.put_many(blocks.items()))
        for d in fleet.nodes:  # sealed and in the bucket: what the survivors take over
            assert call(d.base, "POST", "/v1/admin/flush").body["tier"] == "mirrored"
        reads: list[tuple[float, int]] = []  # (when, blocks missed)
        done = asyncio.Event()

        async def read_all() -> None:
            while not done.is_set():
                got = await kv.get_many(keys)
                reads.append((time.monotonic(), sum(g != blocks[k] for k, g in zip(keys, got, strict=True))))
                await asyncio.sleep(0.02)

        reader = asyncio.create_task(read_all())
        try:
            for _ in range(RETURNS):
                n1.stop(signal.SIGKILL)
                await asyncio.to_thread(
                    until,
                    "node-1 declared dead",
                    lambda: fleet.member(n0, "node-1")["state"] == "dead",
                    4 * DEAD_AFTER_S,
                )
                while not (reads and reads[-1][1] == 0):  # the survivors serve node-1's blocks
                    await asyncio.sleep(0.05)
                restarted = time.monotonic()
                await asyncio.to_thread(n1.start)
                await asyncio.to_thread(
                    until, "node-1 alive", lambda: fleet.member(n0, "node-1")["state"] == "alive", 20
                )
                back = time.monotonic()
                while time.monotonic() - back < HANDBACK_S + 2:  # past the survivors' hand-back
                    await asyncio.sleep(0.1)
                through = [missed for when, missed in reads if when >= restarted]
                assert len(through) > 20, "too few reads to tell"
                assert sum(through) == 0, f"{sum(m > 0 for m in through)} of {len(through)} reads missed blocks"
        finally:
            done.set()
            await reader
    survivors = n0.log.read_text() + fleet.nodes[2].log.read_text()
    assert survivors.count("node-1 is back: its blocks are its own again") == 2 * RETURNS

"""A fleet node's metrics (kvstore/fleet/metrics.py, takeover.py): the members
by state, fenced, the dead nodes' blocks it serves, takeovers' durations.

In-process, on a shared directory with a heartbeat of 0.1 s: the gauges of a
real FleetNode follow a death, an adoption and a fence within a heartbeat.
Then three daemons on moto's S3 server: a survivor's /metrics counts the
killed node's flushed blocks as adopted and one takeover; a node cut from
the bucket says it is fenced. And the merged exposition of several workers
takes the fleet's gauges from the writer alone, never summed."""

from __future__ import annotations

import asyncio
import itertools
import signal
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import TierUnavailable
from kvstore.fleet.bucket import BucketMembership
from kvstore.fleet.metrics import FleetGauges
from kvstore.fleet.node import FleetNode
from kvstore.metrics import Metrics, merged
from kvstore.tier import LocalTier
from kvstore.transport.http.metrics import PER_PROCESS_GAUGES

from ..moto_s3 import S3Env
from .test_bounded_loss import metric
from .test_daemons import DEAD_AFTER_S, HEARTBEAT_S, Fleet, call, until

FLEET_GAUGES = (
    "kvstore_fleet_members",
    "kvstore_fleet_fenced",
    "kvstore_fleet_adopted_nodes",
    "kvstore_fleet_adopted_blocks",
    "kvstore_fleet_takeover_pending",
)


class Adopted:
    """What the gauges read of an adopted store: its tenants and their blocks."""

    def __init__(self, blocks: dict[str, int]) -> None:
        self.blocks = blocks

    def tenant_names(self) -> list[str]:
        return list(self.blocks)

    async def stats(self, tenant: str) -> Any:
        return type("Stats", (), {"blocks": self.blocks[tenant]})()


class Takeover:
    def __init__(self) -> None:
        self.adopted: dict[str, Any] = {}


def gauge(m: Metrics, name: str, **labels: str) -> float | None:
    want = sorted(labels.items())
    for n, ls, v in m.snapshot()["gauges"]:
        if n == name and sorted(map(tuple, ls)) == want:
            return float(v)
    return None


async def test_the_gauges_follow_a_death_an_adoption_and_a_fence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = LocalTier(tmp_path / "bucket")
    a = FleetNode(BucketMembership(tier, "a", "http://127.0.0.1:1", 0.6), heartbeat_s=0.1, dead_after_s=0.6)
    b = FleetNode(BucketMembership(tier, "b", "http://127.0.0.1:2", 0.6), heartbeat_s=0.1, dead_after_s=0.6)
    await a.start()
    await b.start()
    m, takeover = Metrics(), Takeover()
    gauges = FleetGauges(a, takeover, m)  # type: ignore[arg-type]
    a.listeners.append(gauges.on_view)
    sampler = asyncio.get_running_loop().create_task(gauges.run(0.1))
    try:

        async def until_gauge(name: str, value: float, **labels: str) -> None:
            for _ in range(100):
                if gauge(m, name, **labels) == value:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"{name}{labels} is {gauge(m, name, **labels)}, not {value}")

        await until_gauge("kvstore_fleet_members", 2, state="alive")
        assert gauge(m, "kvstore_fleet_members", state="dead") == 0
        assert gauge(m, "kvstore_fleet_fenced") == 0
        assert gauge(m, "kvstore_fleet_takeover_pending") == 0
        assert gauge(m, "kvstore_fleet_adopted_blocks") == 0

        await b.close()  # b falls silent: a declares it dead, and has not taken it over
        await until_gauge("kvstore_fleet_members", 1, state="dead")
        assert gauge(m, "kvstore_fleet_members", state="alive") == 1
        assert gauge(m, "kvstore_fleet_takeover_pending") == 1

        takeover.adopted["b"] = Adopted({"t1": 5, "t2": 7})  # a takeover: counted at the next heartbeat
        await until_gauge("kvstore_fleet_adopted_blocks", 12)
        assert gauge(m, "kvstore_fleet_adopted_nodes") == 1
        assert gauge(m, "kvstore_fleet_takeover_pending") == 0

        async def unreachable(name: str, data: bytes, etag: str | None) -> str:
            raise TierUnavailable("the bucket is away")

        real = tier.put_if
        monkeypatch.setattr(tier, "put_if", unreachable)  # no heartbeat: fenced, with no change of view
        await until_gauge("kvstore_fleet_fenced", 1)
        monkeypatch.setattr(tier, "put_if", real)
        await until_gauge("kvstore_fleet_fenced", 0)
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        await a.close()


def test_the_fleet_gauges_are_the_writers_never_summed_over_workers() -> None:
    writer, reader = Metrics(), Metrics()
    writer.set("kvstore_fleet_members", 2, state="alive")
    writer.set("kvstore_fleet_fenced", 1)
    writer.set("kvstore_fleet_adopted_blocks", 40)
    writer.observe("kvstore_fleet_takeover_seconds", 42.0)
    reader.set("kvstore_fleet_fenced", 0)  # (a reader never sets them; if one did, the writer's still win)
    reader.inc("kvstore_http_requests_total")
    assert not set(FLEET_GAUGES) & PER_PROCESS_GAUGES
    whole = merged([writer.snapshot(), reader.snapshot()], PER_PROCESS_GAUGES)  # the writer's first
    assert gauge(whole, "kvstore_fleet_members", state="alive") == 2
    assert gauge(whole, "kvstore_fleet_fenced") == 1
    assert gauge(whole, "kvstore_fleet_adopted_blocks") == 40
    text = whole.render()
    assert "kvstore_fleet_takeover_seconds_count 1\n" in text
    # A takeover opens a dead node's segments one after another: minutes for a
    # day's; the histogram's buckets go past the 10 s of other durations.
    assert 'kvstore_fleet_takeover_seconds_bucket{le="30"} 0\n' in text
    assert 'kvstore_fleet_takeover_seconds_bucket{le="60"} 1\n' in text


def test_a_survivor_counts_what_it_took_over_and_a_cut_node_says_it_is_fenced(tmp_path: Path, s3: S3Env) -> None:
    fleet = Fleet(tmp_path, s3, 3)
    try:
        fleet.start()
        n0, n1, n2 = fleet.nodes
        for d in fleet.nodes:
            until(
                f"{d.base} counts 3 alive",
                lambda d=d: metric(d, "kvstore_fleet_members", '{state="alive"}') == 3,  # type: ignore[misc]
                5,
            )
            assert metric(d, "kvstore_fleet_fenced") == 0
            assert metric(d, "kvstore_fleet_adopted_blocks") == 0
        t = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "m", "policy": "direct"})
        assert t.status == 201, t
        token = t.body["token"]
        fleet.wait_token(token)
        for key in itertools.islice(fleet.keys_on(n1, "k"), 7):  # node-1's own keys (a node stores only those)
            assert call(n1.base, "PUT", f"/v1/blocks/{key}", token, data=b"x" * 2000).status == 201
        assert call(n1.base, "POST", "/v1/admin/flush").status == 200  # sealed and in the bucket
        n1.stop(signal.SIGKILL)
        until(
            "node-0 serves node-1's 7 blocks",
            lambda: metric(n0, "kvstore_fleet_adopted_blocks") == 7,
            4 * DEAD_AFTER_S + 10,
        )
        assert metric(n0, "kvstore_fleet_members", '{state="dead"}') == 1
        assert metric(n0, "kvstore_fleet_members", '{state="alive"}') == 2
        assert metric(n0, "kvstore_fleet_adopted_nodes") == 1
        assert metric(n0, "kvstore_fleet_takeover_pending") == 0
        assert metric(n0, "kvstore_fleet_takeover_seconds_count") == 1
        took = metric(n0, "kvstore_fleet_takeover_seconds_sum")
        assert 0 < took < 4 * DEAD_AFTER_S + 10, took
        fleet.proxies[2].cut()
        until(
            "node-2 says it is fenced", lambda: metric(n2, "kvstore_fleet_fenced") == 1, DEAD_AFTER_S + 4 * HEARTBEAT_S
        )
        assert metric(n0, "kvstore_fleet_fenced") == 0
        fleet.proxies[2].heal()
        until("node-2 is no longer fenced", lambda: metric(n2, "kvstore_fleet_fenced") == 0, 4 * DEAD_AFTER_S + 10)
    finally:
        fleet.stop()

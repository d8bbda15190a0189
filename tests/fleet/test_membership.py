"""Membership in the bucket (kvstore/fleet/bucket.py) on a real tier, with a
clock the test moves: joins, deaths declared once, a node that comes back as
a new incarnation, a second process with the same id, racing joins; and the
node's fencing (kvstore/fleet/node.py) when its heartbeat cannot be written."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from kvstore_client.sharding import rank_endpoints

from kvstore.errors import Fenced, NewerFormat, NodeAlive, TierUnavailable
from kvstore.fleet.bucket import MEMBERS, BucketMembership
from kvstore.fleet.membership import Superseded
from kvstore.fleet.node import FleetNode
from kvstore.tier import LocalTier, Tier
from kvstore.tier.s3 import S3Tier

from ..moto_s3 import S3Env

DEAD_AFTER = 6.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["local", "s3"])
async def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "local":
        return LocalTier(tmp_path / "bucket")
    s3: S3Env = request.getfixturevalue("s3")
    return S3Tier(s3.bucket, prefix=f"fleet-{tmp_path.name}", endpoint_url=s3.url, path_style=True)


def node(tier: Tier, name: str, clock: Clock) -> BucketMembership:
    return BucketMembership(tier, name, f"http://127.0.0.1:{9000 + ord(name[-1])}", DEAD_AFTER, clock)


async def test_joins_deaths_and_a_node_that_comes_back(tier: Tier) -> None:
    clock = Clock()
    a, b, c = (node(tier, n, clock) for n in ("a", "b", "c"))
    for m in (a, b, c):
        assert await m.join() == 1
    view = await a.observe()
    assert view.version == 3 and [(m.id, m.state, m.incarnation) for m in view.members] == [
        ("a", "alive", 1),
        ("b", "alive", 1),
        ("c", "alive", 1),
    ]
    await b.observe()
    await c.observe()
    # b stops; a and c go on. After dead_after_s of a's clock, a declares b dead, once.
    for _ in range(4):
        clock.now += 2.0
        await a.heartbeat()
        await c.heartbeat()
        view = await a.observe()
        await c.observe()
    assert view.member("b") is not None and view.member("b").state == "dead"  # type: ignore[union-attr]
    assert view.version == 4  # one change: c's observation found b dead already
    assert [m.id for m in view.alive()] == ["a", "c"]
    # b comes back (its own heartbeat still writes: nobody else wrote it), finds itself dead, rejoins.
    await b.heartbeat()
    view = await b.observe()
    assert view.member("b").state == "alive" and view.member("b").incarnation == 2  # type: ignore[union-attr]
    assert view.version == 5
    clock.now += 1.0
    assert (await a.observe()).member("b").incarnation == 2  # type: ignore[union-attr]


async def test_a_second_process_with_the_same_id_supersedes_the_first(tier: Tier) -> None:
    clock = Clock()
    first = node(tier, "a", clock)
    await first.join()
    second = node(tier, "a", clock)
    assert await second.join() == 2
    with pytest.raises(Superseded):
        await first.heartbeat()
    with pytest.raises(Superseded):
        await first.observe()
    await second.heartbeat()
    assert (await second.observe()).member("a").incarnation == 2  # type: ignore[union-attr]


async def test_racing_joins_all_land(tier: Tier) -> None:
    clock = Clock()
    nodes = [node(tier, f"n{i}", clock) for i in range(8)]
    await asyncio.gather(*(m.join() for m in nodes))
    view = await nodes[0].observe()
    assert sorted(m.id for m in view.alive()) == sorted(m.node_id for m in nodes)
    assert view.version == 8  # one version per join, none lost
    got = await tier.get(MEMBERS)
    assert got is not None


async def test_placement_is_the_clients(tier: Tier) -> None:
    clock = Clock()
    for n in ("a", "b", "c"):
        await node(tier, n, clock).join()
    view = await node(tier, "a", clock).observe()
    for key in ("k1", "k2", "some/other-key"):
        assert view.owner(key) == rank_endpoints(view.urls(), key)[0]


async def test_a_node_that_cannot_write_its_heartbeat_fences_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = LocalTier(tmp_path / "bucket")
    n = FleetNode(BucketMembership(tier, "a", "http://127.0.0.1:1", 0.6), heartbeat_s=0.1, dead_after_s=0.6)
    await n.start()
    try:
        assert n.fenced() == ""
        n.check_writable()
        real = tier.put_if

        async def unreachable(name: str, data: bytes, etag: str | None) -> str:
            raise TierUnavailable("the bucket is away")

        monkeypatch.setattr(tier, "put_if", unreachable)
        await asyncio.sleep(0.8)  # more than dead_after_s - heartbeat_s without a heartbeat
        assert "has not written its heartbeat" in n.fenced()
        with pytest.raises(Fenced):
            n.check_writable()
        monkeypatch.setattr(tier, "put_if", real)
        for _ in range(50):
            if not n.fenced():
                break
            await asyncio.sleep(0.05)
        assert n.fenced() == ""  # the bucket is back: a heartbeat, and the node writes again
    finally:
        await n.close()


async def test_a_dead_node_is_forgotten_for_good(tier: Tier) -> None:
    clock = Clock()
    a, b = node(tier, "a", clock), node(tier, "b", clock)
    await a.join()
    await b.join()
    await a.observe()
    with pytest.raises(NodeAlive):
        await a.remove("b")
    clock.now += DEAD_AFTER + 1
    await a.heartbeat()
    assert (await a.observe()).member("b").state == "dead"  # type: ignore[union-attr]
    version = (await a.observe()).version
    assert await a.remove("b")
    view = await a.observe()
    assert view.member("b") is None and view.version == version + 1
    assert not await a.remove("b")  # no such node any more


async def test_the_members_document_carries_its_format_and_a_newer_one_is_never_rewritten(tier: Tier) -> None:
    """Every change writes ``format`` 1; a document without it (the first
    release's) reads as 1; one in a later release's format stops a join and
    an observation with NewerFormat naming the version, and is left exactly
    as it was (rolling upgrades: an older node must not rewrite what a newer
    one wrote). A running node that meets it stops writing."""
    clock = Clock()
    a = node(tier, "a", clock)
    await a.join()
    got = await tier.get(MEMBERS)
    assert got is not None and json.loads(got[0])["format"] == 1
    doc = json.loads(got[0])
    del doc["format"]  # as the first release wrote it
    await tier.put_bytes(MEMBERS, json.dumps(doc).encode())
    assert [m.id for m in (await a.observe()).members] == ["a"]
    b = node(tier, "b", clock)
    await b.join()
    got = await tier.get(MEMBERS)
    assert got is not None and json.loads(got[0])["format"] == 1
    newer = {**json.loads(got[0]), "format": 2, "something": "new"}
    await tier.put_bytes(MEMBERS, json.dumps(newer).encode())
    before = await tier.get(MEMBERS)
    with pytest.raises(NewerFormat, match="format version 2"):
        await node(tier, "c", clock).join()
    with pytest.raises(NewerFormat):
        await a.observe()
    clock.now += 2 * DEAD_AFTER  # b would be declared dead: not by rewriting a newer document
    with pytest.raises(NewerFormat):
        await a.observe()
    after = await tier.get(MEMBERS)
    assert before is not None and after is not None and after[0] == before[0]


async def test_a_running_node_that_meets_a_newer_members_document_stops_writing(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "bucket")
    n = FleetNode(BucketMembership(tier, "a", "http://127.0.0.1:1", 0.6), heartbeat_s=0.1, dead_after_s=0.6)
    await n.start()
    try:
        n.check_writable()
        got = await tier.get(MEMBERS)
        assert got is not None
        await tier.put_bytes(MEMBERS, json.dumps({**json.loads(got[0]), "format": 7}).encode())
        for _ in range(50):
            if n.fenced():
                break
            await asyncio.sleep(0.05)
        assert "format version 7" in n.fenced()
        with pytest.raises(Fenced):
            n.check_writable()
    finally:
        await n.close()

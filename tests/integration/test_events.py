"""Residency events from a real store: every kind of change is an event,
numbered without gaps, and what the events say adds up to what the store
holds (stored minus removed is present). Covers puts, deletes, quota
eviction, TTL expiry, eviction of ephemeral data under disk pressure,
tenant deletion, and tier moves with the S3 tier (moto's server)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.store import Store
from kvstore.events.bus import EventBus, Gap, Subscription
from kvstore.events.model import BlockMeta, Event, key_hash
from kvstore.metrics import Metrics
from tests.conftest import OpenStore
from tests.integration.test_g4 import G4Open, bucket, fill, g4_config, g4_open, local_segments, payload
from tests.integration.test_retention import KiB, block

__all__ = ["bucket", "g4_config", "g4_open"]  # fixtures used here


def attach(store: Store) -> Subscription:
    store.events = EventBus(100_000, 100_000, store.metrics)
    return store.events.subscribe()


def events(sub: Subscription) -> list[Event]:
    items = sub.drain()
    assert not [i for i in items if isinstance(i, Gap)], items
    return [i for i in items if isinstance(i, Event)]


def holdings(evs: list[Event]) -> dict[str, dict[str, set[str]]]:
    """tenant -> tier -> keys, replaying the events."""
    held: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for ev in evs:
        if ev.kind == "cleared":
            held.pop(ev.tenant, None)
        elif ev.kind == "stored":
            assert ev.tier is not None
            held[ev.tenant][ev.tier].update(ev.keys)
        else:
            assert ev.tier is not None
            assert set(ev.keys) <= held[ev.tenant][ev.tier], (ev, held[ev.tenant][ev.tier])
            held[ev.tenant][ev.tier].difference_update(ev.keys)
    return held


async def test_puts_deletes_quota_ttl_and_tenant_deletion(open_store: OpenStore) -> None:
    store = await open_store()
    sub = attach(store)
    await store.create_tenant("q", quota_bytes=1024 * KiB)
    await store.create_tenant("t", ttl_s=1)
    await store.create_tenant("d")
    assert (await store.put("d", "k0", b"x" * 1000)).created
    assert not (await store.put("d", "k0", b"y" * 10)).created  # exists: nothing changes, no event
    assert await store.delete("d", "k0")
    assert not await store.delete("d", "k0")
    for i in range(30):  # ~2 MiB through a 1 MiB quota
        await store.put("q", f"c{i}", block(f"c{i}", 100 * KiB))
    await store.put("t", "a", b"a" * 100)
    await store.put("t", "b", b"b" * 100)
    await asyncio.sleep(1.2)
    assert await store.expire("t") == 2
    await store.put("d", "k1", b"z")
    await store.delete_tenant("d")
    evs = events(sub)
    assert [e.seq for e in evs] == list(range(len(evs)))  # gapless, in order
    assert (evs[0].kind, evs[0].tenant, evs[0].keys, evs[0].sizes, evs[0].tier, evs[0].cause) == (
        "stored",
        "d",
        ("k0",),
        (1000,),
        "local",
        "put",
    )
    assert evs[0].metas[0].block_hash == key_hash("k0")  # no engine identity: the key's hash
    assert (evs[1].kind, evs[1].keys, evs[1].cause, evs[1].tier) == ("removed", ("k0",), "deleted", "local")
    quota = [e for e in evs if e.cause == "quota"]
    assert quota and all(e.kind == "removed" and e.tenant == "q" for e in quota)
    expired = [e for e in evs if e.cause == "expired"]
    assert [(e.tenant, sorted(e.keys)) for e in expired] == [("t", ["a", "b"])]
    assert (evs[-1].kind, evs[-1].tenant, evs[-1].cause) == ("cleared", "d", "tenant_deleted")
    held = holdings(evs)
    assert "d" not in held
    present = {f"c{i}" for i in range(30) if await store.exists("q", f"c{i}")}
    assert held["q"]["local"] == present and 0 < len(present) < 30
    assert held["t"]["local"] == set()
    assert store.metrics.counter("kvstore_events_total", kind="stored") == 34


async def test_ephemeral_blocks_dropped_under_disk_pressure(tmp_path: Path, master: MasterKey) -> None:
    cfg = StoreConfig.from_env(
        tmp_path / "g3",
        env={},
        segment_size="1MiB",
        frame_size="64KiB",
        capacity="4MiB",
        high_watermark=60,
        low_watermark=30,
    )
    s = await Store.open(cfg, master)
    try:
        sub = attach(s)
        await s.create_tenant("cache", durability="ephemeral")
        for i in range(130):
            await s.put("cache", f"c{i:03d}", payload(f"c{i:03d}"))
        await s.evict()
        evs = events(sub)
        evicted = [e for e in evs if e.cause == "evicted"]
        assert evicted and all(e.kind == "removed" and e.tier == "local" for e in evicted)
        present = {f"c{i:03d}" for i in range(130) if await s.exists("cache", f"c{i:03d}")}
        assert holdings(evs)["cache"]["local"] == present
    finally:
        await s.close()


async def test_tier_moves_with_the_object_tier(g4_open: G4Open, g4_config: StoreConfig) -> None:
    s = await g4_open(capacity="64MiB")
    await s.create_tenant("alice")
    blocks = await fill(s, "alice", 16)
    await s.flush(upload_timeout_s=60)
    await s.close()
    s = await g4_open(high_watermark=2, low_watermark=1)  # every local copy goes: the bucket keeps them
    sub = attach(s)
    await s.evict()
    assert local_segments(g4_config.data_dir, "alice") == []
    evs = events(sub)
    assert {e.cause for e in evs} == {"moved"}
    held = holdings([Event(-1, 0, "alice", "stored", "put", "local", tuple(blocks)), *evs])
    assert held["alice"]["object"] == set(blocks) and held["alice"]["local"] == set()
    await s.close()
    s = await g4_open(rehydrate_reads=2)  # room for one segment again
    sub = attach(s)
    await s.get("alice", "k001")
    await s.get("alice", "k002")
    deadline = time.monotonic() + 20
    while not local_segments(g4_config.data_dir, "alice"):
        assert time.monotonic() < deadline, "segment not rehydrated"
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 5
    while s.events is not None and s.events.next_seq < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    back = events(sub)
    assert [(e.kind, e.tier, e.cause) for e in back] == [
        ("stored", "local", "rehydrated"),
        ("removed", "object", "rehydrated"),
    ]
    assert {"k001", "k002"} <= set(back[0].keys) and back[0].keys == back[1].keys


async def test_a_subscriber_that_falls_behind_sees_a_gap_and_the_bus_never_blocks() -> None:
    bus = EventBus(backlog=5, queue_limit=3, metrics=Metrics())
    slow = bus.subscribe()
    only_a = bus.subscribe(tenant="a")
    for i in range(10):
        bus.publish("a" if i % 2 else "b", "stored", "put", "local", [f"k{i}"], [1])
    got = slow.drain()
    assert [e.seq for e in got if isinstance(e, Event)] == [0, 1, 2]
    assert got[-1] == Gap(3, 9)  # dropped while it did not read
    assert [e.seq for e in only_a.drain() if isinstance(e, Event)] == [1, 3, 5]
    assert bus.subscribe(since=2).drain()[0] == Gap(2, 4)  # the backlog keeps 5..9
    resumed = bus.subscribe(since=7).drain()
    assert [e.seq for e in resumed if isinstance(e, Event)] == [7, 8, 9]


async def test_the_engines_identity_is_kept_with_the_block_and_told_on_removal(open_store: OpenStore) -> None:
    store = await open_store()
    sub = attach(store)
    await store.create_tenant("sealed")
    await store.create_tenant("plain", "direct")
    ident = BlockMeta(2**63 + 5, 42, tuple(range(1000, 1016)), 16, None, "adapter-1", [["salt"]])
    for tenant in ("sealed", "plain"):
        assert (await store.put(tenant, "b0", b"x" * 500, ident)).created
        assert (await store.put(tenant, "b1", b"y" * 500)).created
    # Kept in the index: sealed under the tenant's key (token ids are the prompt), plain otherwise.
    raw_sealed, raw_plain = store._index.idents("sealed", ["b0"])[0], store._index.idents("plain", ["b0"])[0]
    assert raw_plain is not None and b"1000,1001" in raw_plain
    assert raw_sealed is not None and b"1000" not in raw_sealed and b"adapter-1" not in raw_sealed
    assert store._index.idents("sealed", ["b1"]) == [None]
    # Blocks moved by compaction keep their identity: the segment is mostly dead, then rewritten.
    for i in range(30):
        await store.put("sealed", f"f{i}", block(f"f{i}", 60 * KiB))
    for i in range(30):
        await store.delete("sealed", f"f{i}")
    before = store._index.get("sealed", "b0")
    await store.flush()
    report = await store.compact("sealed")
    after = store._index.get("sealed", "b0")
    assert report.segments_rewritten and before is not None and after is not None
    assert after.segment_id != before.segment_id
    assert store._index.idents("sealed", ["b0"]) == [raw_sealed]
    for tenant in ("sealed", "plain"):
        assert await store.delete(tenant, "b0") and await store.delete(tenant, "b1")
    evs = events(sub)
    stored = [e for e in evs if e.kind == "stored" and e.keys[0][0] == "b"]
    removed = [e for e in evs if e.kind == "removed" and e.keys[0][0] == "b"]
    assert [e.metas[0] for e in stored] == [ident, BlockMeta.of_key("b1")] * 2
    assert [e.metas[0] for e in removed] == [ident, BlockMeta.of_key("b1")] * 2
    assert store._index.idents("sealed", ["b0"]) == [None]  # gone with the block
    # A removal by quota tells the identity too.
    await store.create_tenant("q", quota_bytes=256 * KiB)
    for i in range(8):
        await store.put("q", f"c{i}", block(f"c{i}", 60 * KiB), BlockMeta(i, i - 1 if i else None, (i,), 1))
    quota = [e for e in events(sub) if e.cause == "quota"]
    assert quota and all(m.block_hash == int(k[1:]) for e in quota for k, m in zip(e.keys, e.metas, strict=True))

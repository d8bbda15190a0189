"""Quotas and TTL on a real store: LRU within a tenant, never across
tenants; expired blocks are misses and their space is reclaimed."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random

import pytest

from kvstore.engine import eviction, retention
from kvstore.errors import InvalidInput, QuotaExceeded
from tests.conftest import OpenStore

KiB = 1024


def block(key: str, size: int = 64 * KiB) -> bytes:
    """Incompressible: stored bytes (what a quota counts) are about its size."""
    return random.Random(key).randbytes(size)


async def test_quota_evicts_own_lru_blocks_only(open_store: OpenStore) -> None:
    store = await open_store()
    await store.create_tenant("small", quota_bytes=1024 * KiB)
    await store.create_tenant("other")
    for i in range(10):
        await store.put("other", f"o{i}", block(f"o{i}"))
    hot = [f"h{i}" for i in range(4)]
    for k in hot:
        await store.put("small", k, block(k))
    for i in range(60):  # ~4 MiB through a 1 MiB quota, the hot ones read all along
        await store.put("small", f"c{i}", block(f"c{i}"))
        for k in hot:
            assert await store.get("small", k) == block(k)
        used = (await store.stats("small")).stored_bytes
        assert used <= 1024 * KiB, f"{used} bytes stored over a 1 MiB quota"
    for k in hot:
        assert await store.exists("small", k), f"hot block {k} was evicted before cold ones"
    assert not await store.exists("small", "c0")
    for i in range(10):  # the other tenant is never touched
        assert await store.get("other", f"o{i}") == block(f"o{i}")
    with pytest.raises(QuotaExceeded):
        await store.put("small", "huge", block("huge", 1100 * KiB))
    public = store.tenant("small")
    assert public["quota_bytes"] == 1024 * KiB and public["ttl_s"] is None


async def test_access_recency_survives_a_restart(open_store: OpenStore) -> None:
    store = await open_store()
    await store.create_tenant("t", quota_bytes=1024 * KiB)
    keys = [f"k{i}" for i in range(14)]  # ~0.9 MiB stored
    for k in keys:
        await store.put("t", k, block(k))
    await asyncio.sleep(0.05)
    for k in keys[:4]:  # the first written are the hottest
        await store.get("t", k)
    await store.close()
    store = await open_store()
    for i in range(4):  # over the quota: the cold ones go, not the first written
        await store.put("t", f"new{i}", block(f"new{i}"))
    for k in keys[:4]:
        assert await store.exists("t", k), f"{k} was read just before the restart and was evicted"
    assert not all([await store.exists("t", k) for k in keys[4:]])


async def test_ttl_makes_idle_blocks_misses_and_reclaims_them(open_store: OpenStore) -> None:
    store = await open_store()
    await store.create_tenant("t", ttl_s=1)
    for i in range(20):
        await store.put("t", f"k{i}", block(f"k{i}"))
    assert (await store.lookup("t", ["k0", "k1"])).prefix == 2
    for _ in range(5):  # k0 is kept alive by reads
        await asyncio.sleep(0.5)
        assert await store.get("t", "k0") == block("k0")
    assert await store.exists("t", "k0")
    assert not await store.exists("t", "k1")
    assert (await store.lookup("t", ["k0", "k1"])).present == [True, False]
    with pytest.raises(Exception) as e:
        await store.get("t", "k1")
    assert e.value.code == "not_found"
    removed = await store.expire("t")
    assert removed == 19
    assert (await store.stats("t")).blocks == 1
    await store.flush()
    report = await store.compact("t")
    assert report.bytes_reclaimed > 0
    assert await store.get("t", "k0") == block("k0")


async def test_set_limits_starts_enforcing_a_lower_quota_and_answers_at_once(open_store: OpenStore) -> None:
    store = await open_store()
    await store.create_tenant("t")
    for i in range(16):
        await store.put("t", f"k{i}", block(f"k{i}"))
    for k in ("k0", "k1"):  # the first written, read since: the last to go
        await store.get("t", k)
    stored = (await store.stats("t")).stored_bytes
    t = await store.set_limits("t", quota_bytes=512 * KiB)
    assert t["quota_bytes"] == 512 * KiB
    assert t["quota_enforcement"] == {"over_bytes": stored - 512 * KiB, "started": True}
    await store.quota_enforced("t")
    after = (await store.stats("t")).stored_bytes
    assert 512 * KiB - 70 * KiB < after <= 512 * KiB, "down to the quota itself, not below it by more than a block"
    assert await store.exists("t", "k0") and await store.exists("t", "k1")
    assert not await store.exists("t", "k2")
    t = await store.set_limits("t", quota_bytes=0, ttl_s=3600)
    assert t["quota_bytes"] is None and t["ttl_s"] == 3600
    assert t["quota_enforcement"] == {"over_bytes": 0, "started": False}


async def test_a_quota_raised_while_a_lower_one_is_enforced_stops_the_removals(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The enforcement goes in steps and reads the quota at every step:
    raised meanwhile, it stops instead of going down to the old one (the
    first step held at its removal, to raise the quota in between)."""
    monkeypatch.setattr(retention, "DROP_CHUNK", 4)
    store = await open_store()
    await store.create_tenant("t")
    for i in range(64):
        await store.put("t", f"k{i}", block(f"k{i}", 16 * KiB))
    gate, removing = asyncio.Event(), asyncio.Event()
    remove = store._retention._remove

    async def held(*args: object) -> int:
        removing.set()
        await gate.wait()
        return await remove(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store._retention, "_remove", held)
    answer = await store.set_limits("t", quota_bytes=16 * KiB)
    assert answer["quota_enforcement"]["started"]
    await asyncio.wait_for(removing.wait(), 10)
    await store.set_limits("t", quota_bytes=0)
    gate.set()
    await store.quota_enforced("t")
    assert (await store.stats("t")).blocks == 60, "one step of 4 removals, then the quota was gone"
    assert not await store.exists("t", "k0") and await store.exists("t", "k4")


async def test_quota_and_ttl_walk_only_what_goes(open_store: OpenStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quota's LRU and the TTL read the index's access order from the
    oldest block: what they read follows what they remove, not what the
    tenant holds (counted at the index)."""
    store = await open_store()
    await store.create_tenant("t")
    for i in range(400):
        await store.put("t", f"k{i:03d}", block(f"k{i}", 4 * KiB))
    walked: list[int] = []
    oldest = store._index.oldest

    def counted(*args: object, **kw: object) -> object:
        page = oldest(*args, **kw)  # type: ignore[arg-type]
        walked.append(len(page))
        return page

    monkeypatch.setattr(store._index, "oldest", counted)
    monkeypatch.setattr(store._retention._index, "oldest", counted)
    used = (await store.stats("t")).stored_bytes
    per_block = used // 400
    await store.set_limits("t", quota_bytes=used - 10 * per_block)
    await store.quota_enforced("t")
    assert (await store.stats("t")).blocks == 390
    assert not await store.exists("t", "k009") and await store.exists("t", "k010")
    assert sum(walked) <= 32, f"the quota read {sum(walked)} entries of the order to remove 10 (16 of slack)"
    walked.clear()
    await asyncio.sleep(0.05)
    for i in range(10, 400):  # all but the last 5 (k395..k399: idle) read now
        if i < 395:
            await store.get("t", f"k{i:03d}")
    await store.set_limits("t", quota_bytes=0, ttl_s=3600)
    assert await store.expire("t") == 0
    assert sum(walked) == 0, "nothing is past a TTL of an hour: the walk stops at the first block"


async def test_the_ttl_sweep_spares_locked_blocks(open_store: OpenStore) -> None:
    """A lookup's lock keeps its blocks through the sweep (not only on reads);
    released, they go at the next sweep once idle past the TTL."""
    store = await open_store()
    await store.create_tenant("t", ttl_s=1)
    for k in ("locked", "free"):
        await store.put("t", k, block(k))
    r, lease = await store.lookup_locked("t", ["locked", "free", "none"], lease_s=30)
    assert r.present == [True, True, False] and lease is not None
    assert lease.owner == "t" and lease.blocks == {("t", "locked"), ("t", "free")}
    store.leases.release(lease.id)
    _, lease = await store.lookup_locked("t", ["locked"], lease_s=30)
    assert lease is not None
    await asyncio.sleep(1.3)
    assert await store.expire("t") == 1  # "free": unlocked, idle past the TTL
    assert await store.get("t", "locked") == block("locked")
    assert store.leases.release_owned(lease.id, "t")
    await asyncio.sleep(1.3)
    assert await store.expire("t") == 1
    assert not await store.exists("t", "locked")


async def test_a_lock_taken_after_eviction_chose_its_victims_spares_them(open_store: OpenStore) -> None:
    """Victims are chosen before they are removed; a lock taken in between
    wins: the removal spares the block, so a lock never finds a block present
    that then goes (white-box: the two steps of an eviction, run apart)."""
    store = await open_store()
    await store.create_tenant("t", quota_bytes=1024 * KiB)
    for i in range(8):
        await store.put("t", f"k{i}", block(f"k{i}"))
    retention = store._retention
    victims = [(c.key, c.entry) for c in retention._victims(store._registry.get("t"), 4 * 64 * KiB).victims]
    chosen = [k for k, _ in victims]
    assert len(chosen) >= 4
    r, lease = await store.lookup_locked("t", chosen[:2], lease_s=30)
    assert r.prefix == 2 and lease is not None
    await retention._remove("t", victims, "quota")
    for k in chosen[:2]:
        assert await store.get("t", k) == block(k)
    for k in chosen[2:]:
        assert not await store.exists("t", k)


@pytest.mark.parametrize("policy", ["lru", "probation"])
async def test_probation_spares_blocks_read_since_they_were_stored(open_store: OpenStore, policy: str) -> None:
    """Four blocks read once, then forty never read through a 1 MiB quota:
    LRU lets the four go with the oldest; on probation the blocks never read
    go first and the four stay."""
    store = await open_store(quota_eviction=policy)
    await store.create_tenant("t", quota_bytes=1024 * KiB)
    read = [f"r{i}" for i in range(4)]
    for k in read:
        await store.put("t", k, block(k))
        assert await store.get("t", k) == block(k)
    for i in range(40):
        await store.put("t", f"c{i}", block(f"c{i}"))
        assert (await store.stats("t")).stored_bytes <= 1024 * KiB
    kept = [await store.exists("t", k) for k in read]
    assert kept == ([True] * 4 if policy == "probation" else [False] * 4)
    assert not await store.exists("t", "c0")
    assert await store.exists("t", "c39")


async def test_a_block_evicted_on_probation_and_stored_again_counts_as_read(open_store: OpenStore) -> None:
    store = await open_store(quota_eviction="probation")
    await store.create_tenant("t", quota_bytes=1024 * KiB)
    await store.put("t", "g", block("g"))
    for i in range(20):
        await store.put("t", f"c{i}", block(f"c{i}"))
    assert not await store.exists("t", "g"), "the oldest block, never read, should have gone first"
    await store.put("t", "g", block("g"))  # it comes back: remembered as evicted on probation
    for i in range(40):
        await store.put("t", f"d{i}", block(f"d{i}"))
    assert await store.get("t", "g") == block("g")
    assert store._retention._probation["t"].share > 0.1, "its return should have lengthened probation"
    # A tenant deleted and created again forgets what its predecessor evicted.
    await store.delete_tenant("t")
    assert "t" not in store._retention._probation, "a deleted tenant's ghosts should be gone from memory"
    await store.create_tenant("t", quota_bytes=1024 * KiB)
    await store.put("t", "g", block("g"))
    for i in range(40):
        await store.put("t", f"e{i}", block(f"e{i}"))
    assert not await store.exists("t", "g")


async def test_a_tenants_own_eviction_overrides_the_nodes(open_store: OpenStore) -> None:
    """The node evicts by LRU; a tenant created with ``eviction=probation``
    keeps its blocks read since they were stored where its neighbour, on the
    node's policy, lets them go; set back to null it follows the node."""
    store = await open_store(quota_eviction="lru")
    await store.create_tenant("p", quota_bytes=1024 * KiB, eviction="probation")
    await store.create_tenant("n", quota_bytes=1024 * KiB)
    assert store.tenant("p")["eviction"] == "probation" and store.tenant("n")["eviction"] is None
    for name in ("p", "n"):
        for k in ("r0", "r1"):
            await store.put(name, k, block(k))
            await store.get(name, k)
        for i in range(40):
            await store.put(name, f"c{i}", block(f"c{i}"))
    assert [await store.exists("p", k) for k in ("r0", "r1")] == [True, True]
    assert [await store.exists("n", k) for k in ("r0", "r1")] == [False, False]
    with pytest.raises(InvalidInput, match="'eviction'"):
        await store.set_limits("p", eviction="lfu")
    with pytest.raises(InvalidInput, match="'eviction'"):
        await store.create_tenant("q", eviction="mru")
    assert "q" not in [t["name"] for t in store.tenants()]
    await store.set_limits("p", eviction="")
    assert store.tenant("p")["eviction"] is None
    await store.close()
    store = await open_store(quota_eviction="probation")  # the registry keeps it; null follows the node
    assert store._retention.policy(store._registry.get("p")) == "probation"
    await store.set_limits("n", eviction="lru")
    assert store._retention.policy(store._registry.get("n")) == "lru"


async def test_admission_is_refused_with_a_tenants_own_probation_and_evicts_by_lru_otherwise(
    open_store: OpenStore,
) -> None:
    """Admission and ``probation`` both keep blocks used once off the disk;
    together they lost the first reuses (below either alone), so a tenant's
    own ``probation`` refuses ``admit_after`` > 1 (400 naming it, saying
    why), and a tenant with admission that sets no eviction evicts by
    ``lru`` on a node whose ``quota_eviction`` is ``probation``."""
    store = await open_store(quota_eviction="probation")
    with pytest.raises(InvalidInput, match=r"'admit_after' must be 1 under eviction 'probation'.*first reuses"):
        await store.create_tenant("a", eviction="probation", admit_after=2)
    assert "a" not in [t["name"] for t in store.tenants()]
    await store.create_tenant("a", admit_after=2)
    assert store._retention.policy(store._registry.get("a")) == "lru"
    with pytest.raises(InvalidInput, match="'admit_after'"):
        await store.set_limits("a", eviction="probation")
    await store.create_tenant("p", eviction="probation")
    with pytest.raises(InvalidInput, match="'admit_after'"):
        await store.set_limits("p", admit_after=3)
    await store.set_limits("p", eviction="lru", admit_after=3)  # both at once: admission under lru
    assert store.tenant("p")["admit_after"] == 3 and store.tenant("p")["eviction"] == "lru"
    await store.set_limits("a", admit_after=1)
    assert store._retention.policy(store._registry.get("a")) == "probation"


async def test_what_probation_learnt_survives_a_restart_and_goes_with_its_tenant(open_store: OpenStore) -> None:
    """The share and both ghost lists are kept in the index at a clean stop
    and read back at start-up (and shown as metrics); a deleted tenant's go."""
    store = await open_store(quota_eviction="probation")
    await store.create_tenant("t", quota_bytes=1024 * KiB)
    await store.put("t", "g", block("g"))
    for i in range(20):
        await store.put("t", f"c{i}", block(f"c{i}"))
    await store.put("t", "g", block("g"))  # a ghost of the first list comes back
    for i in range(40):
        await store.put("t", f"d{i}", block(f"d{i}"))
    before = store._retention._probation["t"]
    assert before.share > 0.1 and len(before.evicted_new) > 0
    learnt = (before.share, list(before.evicted_new.items()), list(before.evicted_reused.items()))
    await store.close()
    store = await open_store(quota_eviction="probation")
    after = store._retention._probation["t"]
    assert (after.share, list(after.evicted_new.items()), list(after.evicted_reused.items())) == learnt
    text = store.metrics.render()
    assert f'kvstore_tenant_eviction_share{{tenant="t"}} {after.share}' in text
    assert f'kvstore_tenant_eviction_ghosts{{list="probation",tenant="t"}} {len(after.evicted_new)}' in text
    await store.delete_tenant("t")
    assert "t" not in store._index.policy_states()
    assert "kvstore_tenant_eviction" not in store.metrics.render()


async def test_probations_walks_choose_what_a_scan_of_every_block_chooses(open_store: OpenStore) -> None:
    """Under ``probation`` the writer walks its index (the blocks stored since
    the last eviction, then each kind of block from the oldest) instead of
    scanning every block: it must choose what ``eviction.probation`` chooses
    from every block, ghosts that came back included, round after round."""
    store = await open_store(quota_eviction="probation")
    await store.create_tenant("t", "direct")
    rng = random.Random(7)
    keys = [f"k{i:03d}" for i in range(60)]
    for k in keys:
        await store.put("t", k, block(k, 4 * KiB))
        await asyncio.sleep(0.002)  # distinct times: the scan and the walks break ties differently
    for k in rng.sample(keys, 20):
        await store.get("t", k)
        await asyncio.sleep(0.002)
    ret = store._retention
    t = dataclasses.replace(store._registry.get("t"), quota_bytes=60 * 5 * KiB)

    def every_block() -> list[eviction.Candidate]:
        blocks_now = store._index.entries("t", None, 10_000)
        times = store._index.accessed("t", [k for k, _ in blocks_now])
        return [
            eviction.Candidate(k, e, e.created_ns // 1_000_000, a) for (k, e), a in zip(blocks_now, times, strict=True)
        ]

    for round_ in range(4):
        await ret.checkpoint()
        need = rng.randrange(20, 60) * 5 * KiB
        expected = eviction.probation(every_block(), need, t.quota_bytes, copy.deepcopy(ret._probation_of(t)))
        got = ret._victims(t, need)
        assert [c.key for c in got.victims] == [c.key for c in expected.victims], round_
        assert (got.on_probation, got.after_reads) == (expected.on_probation, expected.after_reads)
        assert [c.key for c in got.returned_new] == [c.key for c in expected.returned_new]
        assert (got.returned_reused, got.share, got.held) == (expected.returned_reused, expected.share, expected.held)
        assert store._index.fresh_bytes("t") == sum(c.size for c in every_block() if not eviction.read_since_stored(c))
        await ret._remove("t", [(c.key, c.entry) for c in got.victims], "quota")
        ret._remember(t, got)
        # some ghosts of each kind come back, and new blocks arrive
        for k in [*got.on_probation[:3], *got.after_reads[:2], *(f"n{round_}-{i}" for i in range(5))]:
            await store.put("t", k, block(k, 4 * KiB))
            await asyncio.sleep(0.002)
        held = [k for k in keys if await store.exists("t", k)]
        for k in rng.sample(held, min(3, len(held))):
            await store.get("t", k)
            await asyncio.sleep(0.002)


async def test_an_unknown_eviction_policy_is_refused_naming_the_setting(open_store: OpenStore) -> None:
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="quota_eviction"):
        await open_store(quota_eviction="lfu")

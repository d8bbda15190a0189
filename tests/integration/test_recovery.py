"""Recovery at open: the index is a cache of the segments."""

from __future__ import annotations

import shutil

import pytest

from kvstore.engine.format import ALIGN
from kvstore.engine.store import Store
from kvstore.errors import CorruptionError
from tests.conftest import OpenStore
from tests.integration.test_store_roundtrip import block


async def _fill(s: Store, n: int = 12, size: int = 150_000) -> dict[tuple[str, str], bytes]:
    out = {}
    for tenant in ("alice", "direct"):
        for i in range(n):
            k = f"k{i}"
            out[(tenant, k)] = block(tenant + k, size + i)
            await s.put(tenant, k, out[(tenant, k)])
    return out


async def _check(s: Store, blocks: dict[tuple[str, str], bytes]) -> None:
    for (tenant, k), data in blocks.items():
        assert await s.get(tenant, k) == data, (tenant, k)


async def test_index_deleted_is_rebuilt(store: Store, open_store: OpenStore) -> None:
    blocks = await _fill(store)
    await store.delete("alice", "k3")
    del blocks[("alice", "k3")]
    before = await store.stats("alice")
    await store.close()
    shutil.rmtree(store.config.data_dir / "index")
    s = await open_store()
    r = s.recovery
    assert r.index_rebuilt and r.segments_from_footer > 0 and r.records_replayed > 0 and not r.corrupt
    await _check(s, blocks)
    assert not await s.exists("alice", "k3")  # the tombstone was replayed too
    assert await s.stats("alice") == before


async def test_stale_index_replays_the_segment_tail(store: Store, open_store: OpenStore) -> None:
    """As if LMDB lost its last commits (metasync off): the tail is replayed."""
    await _fill(store, n=2)
    await store.close()
    old_index = store.config.data_dir.parent / "old-index"
    shutil.copytree(store.config.data_dir / "index", old_index)
    s = await open_store()
    blocks = await _fill(s, n=5)
    await s.delete("alice", "k0")
    del blocks[("alice", "k0")]
    await s.close()
    shutil.rmtree(s.config.data_dir / "index")
    shutil.copytree(old_index, s.config.data_dir / "index")
    s2 = await open_store()
    assert s2.recovery.records_replayed > 0 and not s2.recovery.corrupt
    await _check(s2, blocks)
    assert not await s2.exists("alice", "k0")


async def test_torn_tail_is_truncated(store: Store, open_store: OpenStore) -> None:
    blocks = await _fill(store, n=3)
    await store.close()
    seg = max((store.config.data_dir / "segments" / "alice").glob("*.seg"))
    size = seg.stat().st_size
    raw = seg.read_bytes()
    # Append the first half of a copy of the last complete record: a torn write.
    last = raw.rfind(b"KVR1", 0, size)
    with seg.open("ab") as f:
        f.write(raw[last : last + (size - last) // 2])
    s = await open_store()
    assert s.recovery.truncated and s.recovery.truncated[0][1] == size
    assert seg.stat().st_size == size and not s.recovery.corrupt
    await _check(s, blocks)
    # Writes continue after the cut.
    await s.put("alice", "after", b"after the tear")
    assert await s.get("alice", "after") == b"after the tear"


async def test_garbage_tail_after_index_loss(store: Store, open_store: OpenStore) -> None:
    blocks = await _fill(store, n=3)
    await store.close()
    seg = max((store.config.data_dir / "segments" / "direct").glob("*.seg"))
    size = seg.stat().st_size
    with seg.open("ab") as f:
        f.write(b"KVR1" + b"\xff" * (ALIGN * 2))
    shutil.rmtree(store.config.data_dir / "index")
    s = await open_store()
    assert [(t[1], t[2]) for t in s.recovery.truncated] == [(size, ALIGN * 2 + 4)]
    await _check(s, blocks)


async def test_missing_segment_drops_its_entries(store: Store, open_store: OpenStore) -> None:
    blocks = await _fill(store, n=14)  # several 1 MiB segments per tenant
    await store.flush()
    await store.close()
    first = min((store.config.data_dir / "segments" / "alice").glob("*.seg"))
    first.unlink()
    s = await open_store()
    assert s.recovery.entries_dropped > 0
    assert any("missing" in c[2] for c in s.recovery.corrupt)
    lost = [k for (t, k) in blocks if t == "alice" and not await s.exists("alice", k)]
    assert 0 < len(lost) < 14
    await _check(s, {(t, k): v for (t, k), v in blocks.items() if not (t == "alice" and k in lost)})
    assert (await s.stats("alice")).blocks == 14 - len(lost)


async def test_clean_reopen_repairs_nothing(store: Store, open_store: OpenStore) -> None:
    blocks = await _fill(store, n=4)
    await store.close()
    s = await open_store()
    assert not s.recovery.repaired and not s.recovery.corrupt
    await _check(s, blocks)


async def test_flipped_payload_byte_is_a_corruption_error(store: Store) -> None:
    await store.put("alice", "victim", block("victim", 100_000))
    await store.put("alice", "bystander", block("bystander", 100_000))
    seg = max((store.config.data_dir / "segments" / "alice").glob("*.seg"))
    entry = await store.head("alice", "victim")
    raw = bytearray(seg.read_bytes())
    at = raw.index(b"victim") + 2000  # inside the first record's payload
    raw[at] ^= 0x10
    seg.write_bytes(raw)
    with pytest.raises(CorruptionError, match=r"segment alice/0000000000000001\.seg, offset 4096"):
        await store.get("alice", "victim")
    assert entry.size == 100_000
    assert store.metrics.counter("kvstore_corruption_total") == 1
    assert await store.get("alice", "bystander") == block("bystander", 100_000)
    report = await store.verify()
    assert [e[1] for e in report.errors] == [4096]

"""A frame size per tenant: its records get it (ranged reads of sealed
blocks decode only the frames they cover), a PATCH changes it for new
records only, it survives a restart, and bad values name the field."""

from __future__ import annotations

import random

import pytest

from kvstore.engine.format import decode_record_header
from kvstore.engine.store import Store
from kvstore.errors import InvalidInput
from tests.conftest import OpenStore, kv_sample

KiB = 1024


def frames_of(store: Store, tenant: str, key: str) -> tuple[int, int]:
    """(frame size, frame count) of the record the index names for ``key``."""
    entry = store._index.get(tenant, key)
    assert entry is not None
    seg = store.config.data_dir / "segments" / tenant / f"{entry.segment_id:016x}.seg"
    with seg.open("rb") as f:
        f.seek(entry.offset)
        header = decode_record_header(f.read(entry.payload_offset), str(seg), entry.offset)
    return header.frame_size, len(header.frames)


@pytest.mark.parametrize("policy", ["sealed", "direct"])
async def test_records_get_their_tenants_frame_size(open_store: OpenStore, policy: str) -> None:
    store = await open_store()  # the store's frame_size: 64 KiB (tests/conftest.py)
    t = await store.create_tenant("t", policy, frame_size=16 * KiB)
    assert t["frame_size"] == 16 * KiB
    other = await store.create_tenant("o", policy)
    assert other["frame_size"] is None
    data = kv_sample("gemma3-270m.bf16.layers8-9.bin")[: 200 * KiB + 5]
    await store.put("t", "k", data)
    await store.put("o", "k", data)
    assert frames_of(store, "t", "k") == (16 * KiB, 13)
    assert frames_of(store, "o", "k") == (64 * KiB, 4)
    rng = random.Random(policy)
    for _ in range(40):
        a = rng.randrange(len(data))
        b = rng.randrange(a + 1, len(data) + 1)
        assert await store.get_range("t", "k", a, b) == data[a:b]
    assert await store.get("t", "k") == data

    # A PATCH applies to new records; the old one keeps its frames.
    assert (await store.set_limits("t", frame_size=128 * KiB))["frame_size"] == 128 * KiB
    await store.put("t", "k2", data)
    assert frames_of(store, "t", "k2") == (128 * KiB, 2)
    assert frames_of(store, "t", "k") == (16 * KiB, 13)
    await store.set_limits("t", frame_size=0)  # back to the store's
    await store.put("t", "k3", data)
    assert frames_of(store, "t", "k3") == (64 * KiB, 4)
    await store.set_limits("t", frame_size=32 * KiB)
    await store.close()

    again = await open_store()
    assert again.tenant("t")["frame_size"] == 32 * KiB
    for k in ("k", "k2", "k3"):
        assert await again.get("t", k) == data


async def test_a_bad_frame_size_names_the_field(open_store: OpenStore) -> None:
    store = await open_store()
    for bad in (1000, 4 * KiB + 1, 128 * 1024 * KiB, -4096):
        with pytest.raises(InvalidInput, match="frame_size"):
            await store.create_tenant("t", frame_size=bad)
    assert store.tenants() == []
    await store.create_tenant("t")
    with pytest.raises(InvalidInput, match="frame_size"):
        await store.set_limits("t", frame_size=3 * KiB)
    assert store.tenant("t")["frame_size"] is None

"""What a block costs on disk is what docs/API.md says (record.py's
block_record_len): a real store's ``bytes_stored`` grows by exactly that for
incompressible blocks, sealed and direct, across page and frame edges."""

from __future__ import annotations

import random

import pytest

from kvstore.engine.record import block_record_len
from tests.conftest import OpenStore

KiB = 1024
SIZES = [1, 4 * KiB - 200, 4 * KiB, 16 * KiB, 64 * KiB, 64 * KiB + 1, 256 * KiB, 1024 * KiB]


@pytest.mark.parametrize("policy", ["sealed", "direct"])
async def test_bytes_stored_grow_by_the_documented_record_length(open_store: OpenStore, policy: str) -> None:
    store = await open_store()  # frames of 64 KiB (tests/conftest.py): 64 KiB + 1 is two frames
    await store.create_tenant("cost", policy)
    frame_size = store.config.frame_size
    for size in SIZES:
        key = f"block-{size}"
        before = (await store.stats("cost")).stored_bytes
        await store.put("cost", key, random.Random(size).randbytes(size))
        grew = (await store.stats("cost")).stored_bytes - before
        assert grew == block_record_len("cost", key, size, frame_size, sealed=policy == "sealed"), (policy, size)
    # Pages: a 16 KiB block takes 20 KiB either way (its header needs a page of its own).
    assert block_record_len("t", "k" * 40, 16 * KiB, 1 << 20, sealed=True) == 20 * KiB
    assert block_record_len("t", "k" * 40, 16 * KiB, 1 << 20, sealed=False) == 20 * KiB

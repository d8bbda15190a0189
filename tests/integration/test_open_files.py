"""Open files are bounded by ``max_open_segments``, not by the count of
segments (nor of tenants): a store reading from many more sealed segments
than the bound keeps at most about the bound open, and every read is still
right (a file closed past the bound is reopened when next read)."""

from __future__ import annotations

import os
import random

from tests.conftest import OpenStore

KiB = 1024


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _value(i: int) -> bytes:
    return random.Random(i).randbytes(8 * KiB)


async def test_reads_over_many_segments_keep_the_open_files_bounded(open_store: OpenStore) -> None:
    store = await open_store(max_open_segments=16)
    await store.create_tenant("t", "direct")
    before = _fds()
    for i in range(80):  # one block a segment: 80 sealed segments
        await store.put("t", f"k{i}", _value(i))
        await store.flush()
    assert len(list((store.config.data_dir / "segments" / "t").glob("*.seg"))) >= 80
    assert _fds() - before <= 16 + 4, "the writer keeps every segment it sealed open"
    for _ in range(3):
        for i in random.Random(7).sample(range(80), 80):
            assert bytes(await store.get("t", f"k{i}")) == _value(i)
    opened = store._cache.opened
    assert opened <= 16, f"{opened} segment files held open for reads past a bound of 16"
    assert _fds() - before <= 16 + 4, "the process's descriptors grew past the bound"
    assert _fds() < before + 80, "as many files open as segments"

"""A start after a clean stop reads no record header (kvstore/engine/tails.py);
after a crash it reads only what was unsealed; either way every block is
there and the footers written later name every record.

Used to be: every start read every record header of every tenant's open
segment, after a clean stop too (1,000 tenants of 100 blocks: 100,000
reads, 63.7 s to ready on a busy disk), and opened every sealed segment.
"""

from __future__ import annotations

import os
import shutil

from kvstore.config import StoreConfig
from kvstore.engine import tails
from tests.conftest import OpenStore

TENANTS = 40
BLOCKS = 12


async def _write(open_store: OpenStore) -> dict[tuple[str, str], bytes]:
    """Every tenant with a sealed segment and an open one after it."""
    store = await open_store()
    blocks = {}
    for t in range(TENANTS):
        await store.create_tenant(f"t{t:03d}", "direct" if t % 2 else "sealed")
    for i in range(BLOCKS):
        if i == BLOCKS // 2:
            await store.flush()  # (seals every tenant's open segment)
        for t in range(TENANTS):
            name = f"t{t:03d}"
            blocks[(name, f"k{i}")] = os.urandom(1000 + 37 * i + t)
            await store.put(name, f"k{i}", blocks[(name, f"k{i}")])
    await store.close()
    return blocks


async def test_a_start_after_a_clean_stop_reads_no_record_header(open_store: OpenStore, config: StoreConfig) -> None:
    blocks = await _write(open_store)
    assert (config.data_dir / tails.FILE_NAME).exists()
    store = await open_store()
    r = store.recovery
    assert (r.open_from_stop, r.records_replayed, r.truncated, r.corrupt) == (TENANTS, 0, [], [])
    assert not (config.data_dir / tails.FILE_NAME).exists()  # used once
    for (t, k), v in blocks.items():
        assert await store.get(t, k) == v
    # The footers taken at start (decoded only now) go into the seals: every record named.
    await store.put("t000", "more", b"m" * 3000)
    await store.flush()
    await store.close()
    shutil.rmtree(config.data_dir / "index")  # rebuilt from the segments' footers and records alone
    store = await open_store()
    assert store.recovery.index_rebuilt
    for (t, k), v in blocks.items():
        assert await store.get(t, k) == v
    assert await store.get("t000", "more") == b"m" * 3000


async def test_after_a_crash_only_what_was_unsealed_is_read(open_store: OpenStore, config: StoreConfig) -> None:
    blocks = await _write(open_store)
    store = await open_store()  # takes the clean stop's footers, then writes more
    for t in range(0, TENANTS, 4):
        await store.put(f"t{t:03d}", "late", b"L" * 4000)
        blocks[(f"t{t:03d}", "late")] = b"L" * 4000
    # A crash: no clean stop (no footers left behind). The appenders' writes are durable (fsync).
    store._tails.clear()  # (what a killed process leaves: nothing of its memory)
    for app in list(store._appenders.values()):
        await app.close()
    store._appenders.clear()
    await store._residency.close()
    await store._run(store._index.close)
    os.close(store._lock_fd)
    store._lock_fd = -1
    store._closed = True  # (gone: the fixture must not close it again)
    assert not (config.data_dir / tails.FILE_NAME).exists()
    again = await open_store()
    r = again.recovery
    assert r.open_from_stop == 0 and r.records_replayed == 0 and not r.truncated and not r.corrupt
    for (t, k), v in blocks.items():
        assert await again.get(t, k) == v


async def test_a_footers_file_that_does_not_check_is_ignored(open_store: OpenStore, config: StoreConfig) -> None:
    blocks = await _write(open_store)
    path = config.data_dir / tails.FILE_NAME
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(raw)
    store = await open_store()
    assert store.recovery.open_from_stop == 0  # scanned instead
    for (t, k), v in blocks.items():
        assert await store.get(t, k) == v

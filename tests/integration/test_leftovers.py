"""What older releases left in a data directory and this one does not use is
removed at start-up, and the log says so.

Used to be: ``DATA/qos-rates`` (the QoS token buckets, a file every worker
mapped before they moved to shared memory) stayed in every data directory
an older build had served, for ever."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from tests.conftest import OpenStore


async def test_a_leftover_qos_rates_file_is_removed_at_start_up(
    open_store: OpenStore, config: StoreConfig, caplog: pytest.LogCaptureFixture
) -> None:
    store = await open_store()
    await store.create_tenant("t")
    await store.put("t", "k", b"block" * 1000)
    await store.close()
    leftover = Path(config.data_dir) / "qos-rates"
    leftover.write_bytes(b"\0" * 4096)
    with caplog.at_level(logging.INFO, logger="kvstore.engine.store"):
        store = await open_store()
    assert not leftover.exists()
    assert any("removed" in r.getMessage() and "qos-rates" in r.getMessage() for r in caplog.records)
    assert await store.get("t", "k") == b"block" * 1000

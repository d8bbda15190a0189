"""Shared fixtures: a real store on a real temporary directory."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import StoreConfig
from kvstore.crypto import MasterKey
from kvstore.store import Store

KV_DIR = Path(__file__).parent / "data" / "kv"


def kv_sample(name: str) -> bytes:
    """A real KV-cache slice (see tests/data/kv/README.md)."""
    return (KV_DIR / name).read_bytes()


@pytest.fixture
def master() -> MasterKey:
    return MasterKey(os.urandom(32))


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def config(data_dir: Path) -> StoreConfig:
    """Small segments and frames so that tests cross segment and frame boundaries."""
    return StoreConfig.from_env(data_dir, env={}, segment_size="1MiB", frame_size="64KiB", max_block_size="4MiB")


OpenStore = Callable[..., Awaitable[Store]]


@pytest.fixture
async def open_store(config: StoreConfig, master: MasterKey) -> AsyncIterator[OpenStore]:
    """Open stores on the test's data directory; all are closed at the end."""
    opened: list[Store] = []

    async def _open(cfg: StoreConfig | None = None, key: MasterKey | None = None, **changes: Any) -> Store:
        c = (cfg or config).with_(**changes) if changes else (cfg or config)
        s = await Store.open(c, key or master)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        await s.close()


@pytest.fixture
async def store(open_store: OpenStore) -> Store:
    s = await open_store()
    await s.create_tenant("alice")
    await s.create_tenant("bob")
    await s.create_tenant("direct", "direct")
    return s

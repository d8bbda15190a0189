"""The fleet's tenant registry (kvstore/fleet/registry.py) between two real
stores on one tier: admin changes racing on both nodes all land, tokens
issued or revoked on one apply on the other after a pull, a tenant deleted
on one is dropped by the other, and a node with another master key cannot
take the fleet's registry."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from kvstore.engine.api import MasterKey, Store
from kvstore.errors import MasterKeyError, NotFound, TenantNotFound
from kvstore.fleet.registry import REGISTRY, FleetRegistry, adopt_at_start
from kvstore.tier import LocalTier


async def _node(tmp_path: Path, name: str, master: MasterKey) -> Store:
    cfg = StoreConfig.from_env(
        tmp_path / name, env={}, tier_dir=str(tmp_path / "bucket"), fleet=True, node_id=name, segment_size="1MiB"
    )
    tier = LocalTier(tmp_path / "bucket")
    await adopt_at_start(tier, cfg.data_dir / "registry.json", master)
    store = await Store.open(cfg, master)
    reg = FleetRegistry(tier, store.registry_document, store.adopt_registry)
    await reg.pull()
    store.fleet_registry = reg
    return store


@pytest.fixture
async def pair(tmp_path: Path, master: MasterKey) -> AsyncIterator[tuple[Store, Store]]:
    a = await _node(tmp_path, "a", master)
    b = await _node(tmp_path, "b", master)
    yield a, b
    await a.close()
    await b.close()


def _names(s: Store) -> list[str]:
    return sorted(t["name"] for t in s.tenants())


async def _pull(*stores: Store) -> None:
    for s in stores:
        assert s.fleet_registry is not None
        await s.fleet_registry.pull()


async def test_racing_admin_changes_on_two_nodes_all_land(pair: tuple[Store, Store]) -> None:
    a, b = pair
    await asyncio.gather(*((a if i % 2 else b).create_tenant(f"t{i}", "sealed") for i in range(8)))
    tokens = await asyncio.gather(*((a if i % 2 else b).issue_token(f"t{i % 3}") for i in range(6)))
    await _pull(a, b)
    assert _names(a) == _names(b) == [f"t{i}" for i in range(8)]
    for s in (a, b):
        for i, (_tid, token) in enumerate(tokens):
            assert s.authenticate(token) == f"t{i % 3}"  # every token from either node works on both


async def test_revoke_and_delete_apply_on_the_other_node(pair: tuple[Store, Store]) -> None:
    a, b = pair
    await a.create_tenant("x", "sealed")
    await a.create_tenant("y", "direct")
    tid, token = await a.issue_token("x")
    await _pull(b)
    assert b.authenticate(token) == "x"
    await b.put("y", "k", b"on b" * 100)
    await b.revoke_token("x", tid)
    await _pull(a)
    assert a.authenticate(token) is None
    await a.delete_tenant("y")
    await _pull(b)
    assert _names(b) == ["x"]
    with pytest.raises(TenantNotFound):
        await b.get("y", "k")
    await b.create_tenant("y", "direct")  # a new incarnation: the old block is gone
    with pytest.raises(NotFound):
        await b.get("y", "k")


async def test_a_node_with_another_master_key_cannot_join(tmp_path: Path, master: MasterKey) -> None:
    a = await _node(tmp_path, "a", master)
    try:
        await a.create_tenant("x", "sealed")
        assert (tmp_path / "bucket" / REGISTRY).exists()
        with pytest.raises(MasterKeyError):
            await _node(tmp_path, "b", MasterKey(os.urandom(32)))
    finally:
        await a.close()


async def test_registry_changes_from_another_node_while_writes_and_reads_go_on(pair: tuple[Store, Store]) -> None:
    """Node b creates, changes and deletes tenants, and node a takes each of
    its registry documents (pulls), while a's own tenant is written and read
    all along: every acknowledged block is there afterwards, byte-exact."""
    a, b = pair
    await a.create_tenant("busy", "sealed")
    await _pull(b)
    acked: dict[str, bytes] = {}
    stop = asyncio.Event()

    async def writer() -> None:
        i = 0
        while not stop.is_set():
            key, data = f"k{i:04d}", os.urandom(4096 + i % 512)
            await a.put("busy", key, data)
            acked[key] = data
            if i % 5 == 0 and acked:
                some = next(iter(acked))
                assert bytes(await a.get("busy", some)) == acked[some]
            i += 1
            await asyncio.sleep(0)

    async def admin() -> None:
        for i in range(10):
            await b.create_tenant(f"other{i}", "direct")
            await b.issue_token(f"other{i}")
            if i % 2:
                await b.delete_tenant(f"other{i - 1}")
            await _pull(a)
        stop.set()

    await asyncio.gather(writer(), admin())
    assert len(acked) > 10
    for key, data in acked.items():
        assert bytes(await a.get("busy", key)) == data
    assert _names(a) == _names(b) == sorted(["busy", *(f"other{i}" for i in range(1, 10, 2))])

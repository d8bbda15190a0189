"""The fleet's tenant registry (kvstore/fleet/registry.py) between two real
stores on one tier: admin changes racing on both nodes all land, tokens
issued or revoked on one apply on the other after a pull, a tenant deleted
on one is dropped by the other, and a node with another master key cannot
take the fleet's registry. The heartbeat's check: a HEAD while nothing
changed, the document when another node changed it, a revision that grows
with every change; and a node that cannot check refuses tenant operations
(its tenant fence, kvstore/fleet/node.py) until it can again."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from kvstore.engine.api import MasterKey, Store
from kvstore.errors import Fenced, MasterKeyError, NotFound, TenantNotFound, TierUnavailable
from kvstore.fleet.bucket import BucketMembership
from kvstore.fleet.node import FleetNode
from kvstore.fleet.registry import REGISTRY, VERSION_METRIC, FleetRegistry, adopt_at_start
from kvstore.tier import LocalTier
from kvstore.tier.base import ObjectInfo

from ..polling import until


class CountingTier(LocalTier):
    """A local tier that counts whole reads, and can be cut (every call
    fails as an unreachable bucket does: the fault a partition injects)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gets = 0
        self.cut = False

    def _reach(self) -> None:
        if self.cut:
            raise TierUnavailable("the bucket cannot be reached (cut by the test)")

    async def get(self, name: str) -> tuple[bytes, str] | None:
        self._reach()
        self.gets += 1
        return await super().get(name)

    async def head(self, name: str) -> ObjectInfo | None:
        self._reach()
        return await super().head(name)

    async def put_if(self, name: str, data: bytes, etag: str | None) -> str:
        self._reach()
        return await super().put_if(name, data, etag)


async def _node(tmp_path: Path, name: str, master: MasterKey, tier: LocalTier | None = None) -> Store:
    cfg = StoreConfig.from_env(
        tmp_path / name, env={}, tier_dir=str(tmp_path / "bucket"), fleet=True, node_id=name, segment_size="1MiB"
    )
    tier = tier or LocalTier(tmp_path / "bucket")
    await adopt_at_start(tier, cfg.data_dir / "registry.json", master)
    store = await Store.open(cfg, master)
    reg = FleetRegistry(tier, store.registry_document, store.adopt_registry, store.metrics)
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


def _registry(s: Store) -> FleetRegistry:
    assert isinstance(s.fleet_registry, FleetRegistry)
    return s.fleet_registry


def _version_gauge(s: Store) -> float | None:
    return next((v for n, _, v in s.metrics.snapshot()["gauges"] if n == VERSION_METRIC), None)


async def test_the_heartbeats_check_reads_the_document_only_when_it_changed(tmp_path: Path, master: MasterKey) -> None:
    """check() is a HEAD while the fleet's registry stays as this node took
    it, and takes the document once another node changed it: a token issued
    on node a passes on node b after b's next check, and a revoked one is
    refused after the next; each check confirms the registry (``confirmed``)."""
    tier_b = CountingTier(tmp_path / "bucket")
    a = await _node(tmp_path, "a", master)
    b = await _node(tmp_path, "b", master, tier_b)
    try:
        reg_b = _registry(b)
        gets = tier_b.gets
        before = time.monotonic()
        for _ in range(5):
            assert await reg_b.check() is False
        assert tier_b.gets == gets  # five HEADs, no document read
        assert reg_b.confirmed >= before
        await a.create_tenant("x", "sealed")
        tid, token = await a.issue_token("x")
        akid, _secret = await a.issue_s3_key("x")
        assert b.authenticate(token) is None and b.s3_credentials(akid) is None  # (b has not checked yet)
        assert await reg_b.check() is True
        assert tier_b.gets == gets + 1  # one document, for three changes
        assert b.authenticate(token) == "x" and b.s3_credentials(akid) is not None
        await a.revoke_token("x", tid)
        await a.revoke_s3_key("x", akid)
        assert await reg_b.check() is True
        assert b.authenticate(token) is None and b.s3_credentials(akid) is None
    finally:
        await a.close()
        await b.close()


async def test_the_fleets_document_counts_its_changes_in_a_revision(pair: tuple[Store, Store], tmp_path: Path) -> None:
    """Every change written, on either node, adds one to the bucket's
    document's ``revision``; each node exports the revision it holds
    (``kvstore_fleet_registry_version``), and a node's own registry file
    never carries it."""
    a, b = pair
    start = _registry(a).revision
    assert start >= 1 and _version_gauge(a) == start  # the first node's registry, written as revision 1
    await a.create_tenant("x", "direct")
    await b.create_tenant("y", "direct")  # (b takes a's change first: one after the other)
    await a.issue_token("y")
    doc = json.loads((tmp_path / "bucket" / REGISTRY).read_bytes())
    assert doc["revision"] == start + 3
    assert _registry(a).revision == start + 3 and _version_gauge(a) == start + 3
    await _registry(b).check()
    assert _registry(b).revision == start + 3 and _version_gauge(b) == start + 3
    for name in ("a", "b"):
        assert "revision" not in json.loads((tmp_path / name / "registry.json").read_bytes())


async def test_a_node_that_cannot_check_the_registry_refuses_tenant_operations(
    tmp_path: Path, master: MasterKey
) -> None:
    """The tenant fence: a node whose checks fail (the bucket cut) serves
    its tenants until ``dead_after_s - heartbeat_s`` after its last
    confirmation, then refuses bearer tokens and S3 keys (Fenced, naming
    the registry), and serves them again after a check that succeeds."""
    tier = CountingTier(tmp_path / "bucket")
    a = await _node(tmp_path, "a", master, tier)
    member = FleetNode(BucketMembership(tier, "a", "http://a", 0.4), 0.2, 0.4, _registry(a))  # fence after 0.2 s
    a.tenant_fence = member.check_tenants
    try:
        await a.create_tenant("x", "direct")
        _tid, token = await a.issue_token("x")
        akid, _secret = await a.issue_s3_key("x")
        assert member.tenants_fenced() == "" and a.authenticate(token) == "x"
        tier.cut = True
        with pytest.raises(TierUnavailable):
            await _registry(a).check()
        await until("the tenant fence", lambda: member.tenants_fenced() != "", 5)
        assert "has not confirmed the fleet's tenant registry" in member.tenants_fenced()
        with pytest.raises(Fenced, match="refuses tenant operations"):
            a.authenticate(token)
        with pytest.raises(Fenced):
            a.authenticate("kvs_unknown")  # a stale registry cannot say a token is unknown either
        with pytest.raises(Fenced):
            a.s3_credentials(akid)
        tier.cut = False
        await _registry(a).check()
        assert member.tenants_fenced() == ""
        assert a.authenticate(token) == "x" and a.s3_credentials(akid) is not None
    finally:
        a.tenant_fence = None
        await a.close()

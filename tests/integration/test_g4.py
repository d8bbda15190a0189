"""G4: sealed segments mirrored to a real S3 endpoint (moto's server on
127.0.0.1), local copies dropped and read back by ranged GETs, a node rebuilt
from the bucket, a bucket adopted read-only, outages, and G3-only eviction."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import pytest

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.residency import FAIL_FAST_S
from kvstore.engine.store import Store
from kvstore.errors import FlushIncomplete, MasterKeyError, NotFound, ReadOnlyNode, StorageFull, TierUnavailable

from ..moto_s3 import REGION, MotoEndpoint, S3Env

CANARY = b"PLAINTEXT-CANARY-7f3a9c"
BLOCK = 150_000  # several blocks per 1 MiB segment, several frames per block


def payload(key: str, n: int = BLOCK) -> bytes:
    """Incompressible bytes unique to ``key``, with the canary every 16 KiB."""
    data = bytearray(random.Random(key).randbytes(n))
    for at in range(0, n - len(CANARY), 16 << 10):
        data[at : at + len(CANARY)] = CANARY
    return bytes(data)


def new_bucket(endpoint_url: str) -> str:
    name = f"kvs-g4-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint_url, region_name=REGION)
    client.create_bucket(Bucket=name)
    client.close()
    return name


def objects(endpoint_url: str, bucket: str) -> dict[str, bytes]:
    client = boto3.client("s3", endpoint_url=endpoint_url, region_name=REGION)
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", ()):
            out[obj["Key"]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    client.close()
    return out


def local_segments(data_dir: Path, tenant: str) -> list[Path]:
    return sorted((data_dir / "segments" / tenant).glob("*.seg"))


G4Open = Callable[..., Awaitable[Store]]


@pytest.fixture
def bucket(s3: S3Env) -> str:
    return new_bucket(s3.url)


@pytest.fixture
def g4_config(tmp_path: Path, s3: S3Env, bucket: str) -> StoreConfig:
    return StoreConfig.from_env(
        tmp_path / "node-a",
        env={},
        segment_size="1MiB",
        frame_size="64KiB",
        s3_bucket=bucket,
        s3_endpoint=s3.url,
        s3_prefix="cluster-1",
        capacity="4MiB",
        high_watermark=50,
        low_watermark=10,
        rehydrate_reads=0,
        decoded_cache_bytes=0,  # these tests count the object tier's reads: every read must make one
    )


@pytest.fixture
async def g4_open(g4_config: StoreConfig, master: MasterKey) -> AsyncIterator[G4Open]:
    opened: list[Store] = []

    async def _open(cfg: StoreConfig | None = None, key: MasterKey | None = None, **changes: Any) -> Store:
        c = cfg or g4_config
        s = await Store.open(c.with_(**changes) if changes else c, key or master)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        await s.close()


async def fill(s: Store, tenant: str, n: int, prefix: str = "k") -> dict[str, bytes]:
    blocks = {f"{prefix}{i:03d}": payload(f"{tenant}/{prefix}{i:03d}") for i in range(n)}
    for k, v in blocks.items():
        assert (await s.put(tenant, k, v)).created
    return blocks


async def check(s: Store, tenant: str, blocks: dict[str, bytes]) -> None:
    for k, v in blocks.items():
        assert await s.get(tenant, k) == v, k
        assert await s.get_range(tenant, k, 70_000, 70_100) == v[70_000:70_100]


async def test_mirror_flush_drop_and_ranged_reads(g4_open: G4Open, g4_config: StoreConfig, s3: S3Env) -> None:
    s = await g4_open(capacity="64MiB")  # no pressure yet
    await s.create_tenant("alice")
    await s.create_tenant("raw", "direct")
    blocks = await fill(s, "alice", 16)
    raw = await fill(s, "raw", 8)
    report = await s.flush(upload_timeout_s=60)
    assert report == {"flushed": True, "tier": "mirrored"}

    # Every sealed segment is in the bucket, byte for byte, with the registry.
    stored = objects(s3.url, g4_config.s3_bucket)
    assert "cluster-1/registry.json" in stored
    n_segments = 0
    for tenant in ("alice", "raw"):
        local = local_segments(g4_config.data_dir, tenant)
        assert len(local) >= 2
        n_segments += len(local)
        inc = s.tenant(tenant)["created_ns"]
        for path in local:
            assert stored[f"cluster-1/segments/{tenant}/{inc:016x}/{path.name}"] == path.read_bytes()
    assert sum("/segments/" in k for k in stored) == n_segments
    # No plaintext of the sealed tenant in its objects (the check can fire:
    # the direct tenant's objects hold it), no token in the registry copy.
    assert not any(CANARY in v for k, v in stored.items() if "/segments/alice/" in k)
    assert any(CANARY in v for k, v in stored.items() if "/segments/raw/" in k)
    _, token = await s.issue_token("alice")
    await s.flush(upload_timeout_s=60)
    assert token.encode() not in objects(s3.url, g4_config.s3_bucket)["cluster-1/registry.json"]
    await s.close()

    # Disk pressure: every mirrored copy goes; reads fetch single records.
    s = await g4_open()
    await s.evict()
    assert local_segments(g4_config.data_dir, "alice") == local_segments(g4_config.data_dir, "raw") == []
    assert s.metrics.counter("kvstore_evictions_total", kind="mirrored") == n_segments
    await check(s, "alice", blocks)
    await check(s, "raw", raw)
    assert await s.get_buffer("raw", "k003") == raw["k003"]
    assert s.metrics.counter("kvstore_tier_reads_total") == 2 * (len(blocks) + len(raw)) + 1
    downloaded = s.metrics.counter("kvstore_tier_download_bytes_total")
    segment_bytes = sum(len(v) for k, v in stored.items() if "/segments/" in k)
    assert downloaded < 2.5 * segment_bytes  # records, not whole segments, per read
    # Deleting a block of a remote-only segment is a tombstone like any other.
    assert await s.delete("alice", "k000")
    with pytest.raises(NotFound):
        await s.get("alice", "k000")

    # After a restart, the index still knows where the blocks are.
    await s.close()
    s2 = await g4_open()
    assert not s2.recovery.corrupt and s2.recovery.entries_dropped == 0
    del blocks["k000"]
    await check(s2, "alice", blocks)


async def test_rehydrates_a_segment_read_often(g4_open: G4Open, g4_config: StoreConfig) -> None:
    s = await g4_open(capacity="64MiB")
    await s.create_tenant("alice")
    blocks = await fill(s, "alice", 16)
    await s.flush(upload_timeout_s=60)
    await s.close()
    s = await g4_open(high_watermark=2, low_watermark=1)  # everything above 80 KiB goes
    await s.evict()
    assert local_segments(g4_config.data_dir, "alice") == []
    await s.close()
    s = await g4_open(rehydrate_reads=2)  # room for one segment again
    await s.get("alice", "k001")
    await s.get("alice", "k002")  # same segment: the second remote read
    deadline = time.monotonic() + 20
    while not local_segments(g4_config.data_dir, "alice"):
        assert time.monotonic() < deadline, "segment not rehydrated"
        await asyncio.sleep(0.05)
    assert s.metrics.counter("kvstore_tier_rehydrations_total") == 1
    reads = s.metrics.counter("kvstore_tier_reads_total")
    assert await s.get("alice", "k001") == blocks["k001"]
    assert s.metrics.counter("kvstore_tier_reads_total") == reads  # served locally now
    await check(s, "alice", blocks)


async def test_new_node_rebuilds_from_the_bucket(
    g4_open: G4Open, g4_config: StoreConfig, master: MasterKey, tmp_path: Path
) -> None:
    s = await g4_open()
    await s.create_tenant("alice")
    await s.create_tenant("bob", "direct")
    _, token = await s.issue_token("alice")
    blocks = await fill(s, "alice", 12)
    bob = await fill(s, "bob", 6)
    assert await s.delete("alice", "k004")
    del blocks["k004"]
    await s.flush(upload_timeout_s=60)
    await s.close()
    shutil.rmtree(g4_config.data_dir)  # the whole node: segments, index, registry

    s2 = await g4_open()
    assert s2.recovery.segments_from_tier >= 3
    assert {t["name"] for t in s2.tenants()} == {"alice", "bob"}
    assert s2.authenticate(token) == "alice"
    await check(s2, "alice", blocks)
    await check(s2, "bob", bob)
    with pytest.raises(NotFound):
        await s2.get("alice", "k004")
    assert local_segments(g4_config.data_dir, "alice") == []
    # It writes on without overwriting any object of the old node.
    more = await fill(s2, "alice", 8, prefix="new")
    await s2.flush(upload_timeout_s=60)
    await check(s2, "alice", {**blocks, **more})
    await s2.close()
    shutil.rmtree(g4_config.data_dir)
    s3_ = await g4_open()
    await check(s3_, "alice", {**blocks, **more})
    # Another master key cannot use the bucket's registry: start-up fails.
    with pytest.raises(MasterKeyError, match="master key"):
        await Store.open(replace(g4_config, data_dir=tmp_path / "thief"), MasterKey(os.urandom(32)))


async def test_evictions_stay_gone_after_a_rebuild_from_the_bucket(g4_open: G4Open, g4_config: StoreConfig) -> None:
    """Regression (issue 24): quota evictions wrote no record, so a node
    rebuilt from its bucket served every evicted block again."""
    s = await g4_open(capacity="64MiB")
    await s.create_tenant("q", quota_bytes=512 << 10)
    keys = [f"k{i:02d}" for i in range(30)]
    for k in keys:
        await s.put("q", k, _block(k))
    here = await _present(s, "q", keys)
    assert 0 < len(here) < len(keys)
    await s.flush(upload_timeout_s=60)
    await s.close()
    shutil.rmtree(g4_config.data_dir)  # the node's disk is lost

    s2 = await g4_open(capacity="64MiB")
    assert s2.recovery.segments_from_tier >= 1
    assert await _present(s2, "q", keys) == here, "evicted blocks came back after a rebuild from the bucket"
    for k in here:
        assert await s2.get("q", k) == _block(k)


async def _present(store: Store, tenant: str, keys: list[str]) -> set[str]:
    return {k for k, here in zip(keys, await store.present(tenant, keys), strict=True) if here}


def _block(key: str) -> bytes:
    return random.Random(key).randbytes(64 << 10)


async def test_second_node_adopts_the_bucket_read_only(
    g4_open: G4Open, g4_config: StoreConfig, master: MasterKey, tmp_path: Path
) -> None:
    a = await g4_open()
    await a.create_tenant("alice")
    await a.create_tenant("gone")
    blocks = await fill(a, "alice", 10)
    await a.flush(upload_timeout_s=60)
    b = await g4_open(replace(g4_config, data_dir=tmp_path / "node-b", s3_readonly=True))
    await check(b, "alice", blocks)
    assert {t["name"] for t in b.tenants()} == {"alice", "gone"}
    with pytest.raises(ReadOnlyNode):
        await b.put("alice", "x", b"y")
    with pytest.raises(ReadOnlyNode):
        await b.create_tenant("carol")
    more = await fill(a, "alice", 6, prefix="late")
    await a.delete_tenant("gone")
    await a.flush(upload_timeout_s=60)
    assert await b.follow_bucket() >= 1
    await check(b, "alice", more)
    assert {t["name"] for t in b.tenants()} == {"alice"}


async def test_deleted_tenant_objects_leave_the_bucket(g4_open: G4Open, g4_config: StoreConfig, s3: S3Env) -> None:
    s = await g4_open()
    await s.create_tenant("alice")
    await s.create_tenant("carol")
    await fill(s, "alice", 10)
    await fill(s, "carol", 4)
    await s.flush(upload_timeout_s=60)
    assert any("/segments/alice/" in k for k in objects(s3.url, g4_config.s3_bucket))
    await s.delete_tenant("alice")
    deadline = time.monotonic() + 30
    while any("/segments/alice/" in k for k in objects(s3.url, g4_config.s3_bucket)):
        assert time.monotonic() < deadline, "objects of the deleted tenant are still in the bucket"
        await asyncio.sleep(0.1)
    await s.flush(upload_timeout_s=60)
    assert b'"alice"' not in objects(s3.url, g4_config.s3_bucket)["cluster-1/registry.json"]
    # A new tenant of the same name starts a new incarnation: no collision.
    await s.create_tenant("alice")
    fresh = await fill(s, "alice", 8)
    await s.flush(upload_timeout_s=60)
    await check(s, "alice", fresh)


async def test_s3_outage_backlog_drains_and_nothing_is_lost(aws_env: None, tmp_path: Path, master: MasterKey) -> None:
    endpoint = MotoEndpoint()
    endpoint.start()
    try:
        bucket = new_bucket(endpoint.url)
        cfg = StoreConfig.from_env(
            tmp_path / "node",
            env={},
            segment_size="1MiB",
            frame_size="64KiB",
            s3_bucket=bucket,
            s3_endpoint=endpoint.url,
            s3_read_timeout_ms=2000,
            capacity="8MiB",
            high_watermark=2,  # whatever is mirrored is dropped
            low_watermark=1,
            rehydrate_reads=0,
        )
        s = await Store.open(cfg, master)
        try:
            await s.create_tenant("alice")
            early = await fill(s, "alice", 8, prefix="early")
            await s.flush(upload_timeout_s=60)
            await s.evict()  # early blocks now live in S3 only
            assert local_segments(cfg.data_dir, "alice") == []

            endpoint.stop()
            late = await fill(s, "alice", 16, prefix="late")  # writes go on: local
            with pytest.raises(FlushIncomplete, match="not in the object tier"):
                await s.flush(upload_timeout_s=1)
            assert s.metrics.counter("kvstore_tier_errors_total", op="upload") > 0
            assert await s.evict() == 0  # unmirrored persistent segments are never dropped
            await check(s, "alice", late)  # local reads are unaffected
            t0 = time.monotonic()
            with pytest.raises(TierUnavailable) as err:
                await s.get("alice", "early001")
            assert err.value.retryable and err.value.code == "tier_unavailable"
            assert time.monotonic() - t0 < 3 * cfg.s3_read_timeout_ms / 1000

            endpoint.start()  # same port, same bucket contents
            await asyncio.sleep(FAIL_FAST_S)
            await s.flush(upload_timeout_s=60)  # the backlog drains
            n, _ = s._residency.mirror.backlog if s._residency.mirror else (0, 0)
            assert n == 0
            await check(s, "alice", early)
            await s.evict()
            await check(s, "alice", late)
        finally:
            await s.close()
    finally:
        endpoint.stop()


async def test_g3_only_drops_ephemeral_data_and_refuses_persistent_when_full(tmp_path: Path, master: MasterKey) -> None:
    cfg = StoreConfig.from_env(
        tmp_path / "g3",
        env={},
        segment_size="1MiB",
        frame_size="64KiB",
        capacity="4MiB",
        high_watermark=60,
        low_watermark=30,
    )
    s = await Store.open(cfg, master)
    try:
        await s.create_tenant("cache", durability="ephemeral")
        await s.create_tenant("keep")
        assert s.tenant("cache")["durability"] == "ephemeral"
        assert s.tenant("keep")["durability"] == "persistent"
        # Ephemeral: five times the capacity goes in; the oldest blocks drop out.
        written = {}
        for i in range(130):
            k = f"c{i:03d}"
            written[k] = payload(k)
            assert (await s.put("cache", k, written[k])).created
        present = [k for k in written if await s.exists("cache", k)]
        assert 0 < len(present) < len(written)
        assert "c129" in present and "c000" not in present
        for k in present:
            assert await s.get("cache", k) == written[k]
        assert s.metrics.counter("kvstore_evictions_total", kind="ephemeral") > 0
        # Persistent: 507 once full, and every acknowledged block is still there.
        kept = {}
        with pytest.raises(StorageFull) as full:
            for i in range(100):
                k = f"p{i:03d}"
                await s.put("keep", k, payload(k))
                kept[k] = payload(k)
        assert full.value.code == "storage_full"
        assert kept
        await check(s, "keep", kept)
    finally:
        await s.close()


async def test_a_shared_directory_as_the_object_tier(tmp_path: Path, master: MasterKey) -> None:
    """``tier_dir`` (NFS-style shared storage): the same mirroring, dropping and rebuild."""
    cfg = StoreConfig.from_env(
        tmp_path / "node",
        env={},
        segment_size="1MiB",
        frame_size="64KiB",
        tier_dir=str(tmp_path / "shared"),
        capacity="8MiB",
        high_watermark=2,
        low_watermark=1,
        rehydrate_reads=0,
    )
    s = await Store.open(cfg, master)
    await s.create_tenant("alice")
    blocks = await fill(s, "alice", 12)
    await s.flush(upload_timeout_s=60)
    await s.evict()
    assert local_segments(cfg.data_dir, "alice") == []
    assert (tmp_path / "shared" / "registry.json").exists()
    assert not any(CANARY in p.read_bytes() for p in (tmp_path / "shared").rglob("*.seg"))
    await check(s, "alice", blocks)
    await s.close()
    shutil.rmtree(cfg.data_dir)
    s = await Store.open(cfg, master)
    try:
        assert s.recovery.segments_from_tier >= 2
        await check(s, "alice", blocks)
    finally:
        await s.close()

"""Small sealed segments are merged by compaction (``merge_below``), in the
object tier too, while blocks are read; and a store rebuilt from the bucket
(a survivor's takeover reads the same way) finds every block.

Used to be: a tenant writing a trickle on a fleet node (``seal_after_s`` 10 s)
sealed up to 8,640 small segments a day, none ever merged: the bucket's
object count, and the footers a survivor's takeover reads one by one, grew
without bound.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from kvstore.engine.api import MasterKey, Store
from kvstore.engine.index import SEG_SEALED
from tests.moto_s3 import S3Env

SMALL = 12  # small sealed segments made before the pass


def _config(tmp_path: Path, s3: S3Env, bucket: str, **changes: str) -> StoreConfig:
    return StoreConfig.from_env(
        tmp_path / "node",
        env={},
        segment_size="1MiB",  # merge_below: a quarter of it by default
        frame_size="64KiB",
        s3_bucket=bucket,
        s3_endpoint=s3.url,
        s3_prefix=f"merge-{uuid.uuid4().hex[:8]}",
        compact_interval_s="0",  # passes on demand only
        **changes,
    )


@pytest.fixture
def bucket(s3: S3Env) -> str:
    import boto3

    name = f"merge-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    client.close()
    return name


async def _trickle(store: Store, tenant: str, n: int) -> dict[str, bytes]:
    """``n`` small sealed segments, each mirrored: a block written, then a flush."""
    blocks = {}
    for i in range(n):
        key = f"t{i:03d}"
        blocks[key] = os.urandom(3000 + 17 * i)
        await store.put(tenant, key, blocks[key])
        await store.flush(upload_timeout_s=30)
    return blocks


def _sealed(store: Store, tenant: str) -> list[int]:
    return sorted(sid for sid, st in store._index.segments(tenant).items() if st.state == SEG_SEALED)


async def _objects(store: Store) -> int:
    assert store.tier is not None
    return len([o async for o in store.tier.list("segments/")])


async def test_small_sealed_segments_are_merged_while_read(
    aws_env: None, tmp_path: Path, s3: S3Env, bucket: str, master: MasterKey
) -> None:
    cfg = _config(tmp_path, s3, bucket)
    store = await Store.open(cfg, master)
    try:
        await store.create_tenant("t")
        blocks = await _trickle(store, "t", SMALL)
        assert len(_sealed(store, "t")) == SMALL and await _objects(store) == SMALL
        wrong: list[str] = []
        reading = True

        async def read() -> None:  # every block, over and over, while the pass runs
            while reading:
                for k, v in blocks.items():
                    if await store.get("t", k) != v:
                        wrong.append(k)
                await asyncio.sleep(0)

        reader = asyncio.create_task(read())
        report = await store.compact("t")
        await store.flush(upload_timeout_s=30)  # the copies' segment in the bucket ...
        await store.compact("t")  # ... so the next pass deletes the merged objects
        reading = False
        await reader
        assert not wrong, wrong
        assert report.segments_merged == SMALL, report.as_dict()
        assert len(_sealed(store, "t")) <= 2
        assert await _objects(store) <= 2
        for k, v in blocks.items():
            assert await store.get("t", k) == v
    finally:
        await store.close()
    # A node rebuilt from the bucket alone (its disk lost) serves every block: nothing lost or doubled.
    rebuilt = await Store.open(replace(cfg, data_dir=tmp_path / "rebuilt"), master)
    try:
        for k, v in blocks.items():
            assert await rebuilt.get("t", k) == v
        assert (await rebuilt.stats("t")).blocks == len(blocks)
    finally:
        await rebuilt.close()


async def test_fewer_than_four_small_segments_or_merge_below_zero_merge_nothing(
    aws_env: None, tmp_path: Path, s3: S3Env, bucket: str, master: MasterKey
) -> None:
    store = await Store.open(_config(tmp_path, s3, bucket), master)
    try:
        await store.create_tenant("few")
        await _trickle(store, "few", 3)
        assert (await store.compact("few")).segments_merged == 0
    finally:
        await store.close()
    off = await Store.open(replace(_config(tmp_path, s3, bucket, merge_below="0"), data_dir=tmp_path / "off"), master)
    try:
        await off.create_tenant("off")
        await _trickle(off, "off", 6)
        assert (await off.compact("off")).segments_merged == 0
        assert len(_sealed(off, "off")) == 6
    finally:
        await off.close()

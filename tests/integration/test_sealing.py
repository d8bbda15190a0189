"""Sealing before a segment is full (issue 40, bounded loss): with
``seal_after_s`` an open segment whose oldest unsealed record is that old is
sealed and mirrored, so a node's death loses only its last seconds of
writes; off, nothing is sealed before it is full; an idle store seals
nothing; and a store's close (a SIGTERM'd daemon's) seals and uploads its
open segments, and gives up quickly on an unreachable tier. Real files,
real LMDB, moto's S3 server."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.lifecycle import Phase
from kvstore.engine.store import Store
from kvstore.engine.store_sealing import STOP_UPLOAD_TIMEOUT_S

from ..moto_s3 import MotoEndpoint, S3Env
from ..polling import until
from .test_g4 import check, fill, new_bucket, objects

SEAL_AFTER_S = 0.5
Open = Callable[..., Awaitable[Store]]


@pytest.fixture
def sealing_config(tmp_path: Path, s3: S3Env) -> StoreConfig:
    # 64 MiB segments: nothing here is sealed for being full.
    return StoreConfig.from_env(
        tmp_path / "node",
        env={},
        segment_size="64MiB",
        frame_size="64KiB",
        s3_bucket=new_bucket(s3.url),
        s3_endpoint=s3.url,
        s3_prefix="c",
        seal_after_s=SEAL_AFTER_S,
    )


@pytest.fixture
async def open_sealing(sealing_config: StoreConfig, master: MasterKey) -> AsyncIterator[Open]:
    opened: list[Store] = []

    async def _open(cfg: StoreConfig | None = None, **changes: Any) -> Store:
        c = cfg or sealing_config
        s = await Store.open(c.with_(**changes) if changes else c, master)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        await s.close()


def segment_objects(endpoint: str, bucket: str, tenant: str) -> list[str]:
    return sorted(k for k in objects(endpoint, bucket) if f"/segments/{tenant}/" in k)


def gauge(s: Store, name: str) -> float:
    return next(float(v) for n, labels, v in s.metrics.snapshot()["gauges"] if n == name and not labels)


def phases(s: Store, tenant: str) -> list[Phase]:
    return [s._life.phase(tenant, sid) for sid in sorted(s._index.segments(tenant))]


async def test_an_open_segment_is_sealed_and_mirrored_after_seal_after_s(
    open_sealing: Open, sealing_config: StoreConfig, s3: S3Env, tmp_path: Path
) -> None:
    s = await open_sealing()
    await s.create_tenant("alice")
    t0 = time.monotonic()
    blocks = await fill(s, "alice", 4)
    assert phases(s, "alice") == [Phase.OPEN]
    await until("the open segment sealed and mirrored", lambda: phases(s, "alice") == [Phase.MIRRORED], 30)
    took = time.monotonic() - t0
    assert took >= SEAL_AFTER_S, f"sealed {took:.2f} s after the first write, before seal_after_s"
    assert s.metrics.counter("kvstore_segments_sealed_early_total", reason="age") == 1
    assert len(segment_objects(s3.url, sealing_config.s3_bucket, "alice")) == 1
    # What the bucket holds serves every block: a node adopting it (as the
    # fleet's survivors do) reads them all.
    b = await open_sealing(replace(sealing_config, data_dir=tmp_path / "adopter", s3_readonly=True))
    await check(b, "alice", blocks)

    # Idle: no new segment, nothing more sealed, however long it waits.
    assert await s.seal_aged(0) == []
    await asyncio.sleep(4 * SEAL_AFTER_S)
    assert phases(s, "alice") == [Phase.MIRRORED]
    assert s.metrics.counter("kvstore_segments_sealed_early_total", reason="age") == 1
    assert gauge(s, "kvstore_unsealed_oldest_seconds") == 0

    # The next writes open a new segment, sealed in its turn.
    more = await fill(s, "alice", 3, prefix="m")
    await until(
        "the second segment sealed and mirrored", lambda: phases(s, "alice") == [Phase.MIRRORED, Phase.MIRRORED], 30
    )
    assert len(segment_objects(s3.url, sealing_config.s3_bucket, "alice")) == 2
    assert await b.follow_bucket() == 1
    await check(b, "alice", more)


async def test_a_trickle_of_writes_makes_one_segment_per_seal_after_s(open_sealing: Open) -> None:
    """The cost of small segments: a write every tenth of seal_after_s for
    four seal_after_s makes about four segments (one per seal_after_s), not
    one per write."""
    s = await open_sealing()
    await s.create_tenant("alice")
    t0 = time.monotonic()
    i = 0
    acked: dict[str, bytes] = {}
    while time.monotonic() - t0 < 4 * SEAL_AFTER_S:
        data = os.urandom(1000)
        await s.put("alice", f"k{i}", data)
        acked[f"k{i}"] = data
        if i:  # a read of an earlier block, while seals by age go on
            k = f"k{i // 2}"
            assert bytes(await s.get("alice", k)) == acked[k], k
        i += 1
        await asyncio.sleep(SEAL_AFTER_S / 10)
    elapsed = time.monotonic() - t0
    await until("the last segment sealed", lambda: Phase.OPEN not in phases(s, "alice"), 30)
    n = len(phases(s, "alice"))
    assert i >= 20
    for k, data in acked.items():  # every acked block, across the segments sealed under the writes
        assert bytes(await s.get("alice", k)) == data, k
    # One segment per seal_after_s (+1: the last, partial one; +1: a write
    # landing just after a seal opens the next segment at once).
    assert 2 <= n <= elapsed / SEAL_AFTER_S + 2, f"{n} segments for {i} writes in {elapsed:.1f} s"


async def test_off_nothing_is_sealed_before_it_is_full(open_sealing: Open, sealing_config: StoreConfig) -> None:
    s = await open_sealing(seal_after_s=0)
    assert s.config.seal_after == 0
    await s.create_tenant("alice")
    await fill(s, "alice", 4)
    await asyncio.sleep(4 * SEAL_AFTER_S)  # what "on" would have sealed twice over
    assert phases(s, "alice") == [Phase.OPEN]
    assert s.metrics.counter("kvstore_segments_sealed_early_total", reason="age") == 0


async def test_ephemeral_tenants_are_not_sealed_early(open_sealing: Open) -> None:
    """Their segments are never mirrored: sealing them early would only make small segments."""
    s = await open_sealing()
    await s.create_tenant("eph", durability="ephemeral")
    await s.create_tenant("alice")
    await fill(s, "eph", 2)
    await fill(s, "alice", 2)
    await until("alice's segment mirrored", lambda: phases(s, "alice") == [Phase.MIRRORED], 30)
    await asyncio.sleep(2 * SEAL_AFTER_S)
    assert phases(s, "eph") == [Phase.OPEN]


async def test_unsealed_records_left_by_an_earlier_run_are_sealed_after_a_restart(
    open_sealing: Open, sealing_config: StoreConfig
) -> None:
    """A tail recovered with records (left open by a run without the
    object tier here; by a killed node alike) is aged from the start:
    sealed and mirrored seal_after_s later."""
    s = await open_sealing(replace(sealing_config, s3_bucket="", s3_endpoint="", seal_after_s=0))
    await s.create_tenant("alice")
    blocks = await fill(s, "alice", 3)
    await s.close()  # no object tier: its segment stays open
    s2 = await open_sealing()
    assert phases(s2, "alice") == [Phase.OPEN]
    await until("the recovered segment sealed and mirrored", lambda: phases(s2, "alice") == [Phase.MIRRORED], 30)
    await check(s2, "alice", blocks)


async def test_close_seals_and_uploads_the_open_segments(
    open_sealing: Open, sealing_config: StoreConfig, s3: S3Env, tmp_path: Path
) -> None:
    """What a SIGTERM'd daemon does: its store's close seals every open
    segment of a persistent tenant and waits for the upload, whatever
    seal_after_s (off here)."""
    s = await open_sealing(seal_after_s=0)
    await s.create_tenant("alice")
    await s.create_tenant("raw", "direct")
    blocks = await fill(s, "alice", 5)
    raw = await fill(s, "raw", 2)
    assert segment_objects(s3.url, sealing_config.s3_bucket, "alice") == []
    await s.close()
    assert s.metrics.counter("kvstore_segments_sealed_early_total", reason="stop") == 2
    assert len(segment_objects(s3.url, sealing_config.s3_bucket, "alice")) == 1
    assert len(segment_objects(s3.url, sealing_config.s3_bucket, "raw")) == 1
    b = await open_sealing(replace(sealing_config, data_dir=tmp_path / "adopter", s3_readonly=True))
    await check(b, "alice", blocks)
    await check(b, "raw", raw)
    # Reopened, the node appends to a new segment: the sealed one stays as it is.
    s2 = await open_sealing()
    await fill(s2, "alice", 1, prefix="after")
    assert phases(s2, "alice")[0] == Phase.MIRRORED and phases(s2, "alice")[-1] == Phase.OPEN


async def test_close_gives_up_quickly_on_an_unreachable_tier(
    aws_env: None, tmp_path: Path, master: MasterKey, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = MotoEndpoint()
    endpoint.start()
    try:
        cfg = StoreConfig.from_env(
            tmp_path / "node",
            env={},
            segment_size="64MiB",
            frame_size="64KiB",
            s3_bucket=new_bucket(endpoint.url),
            s3_endpoint=endpoint.url,
        )
        s = await Store.open(cfg, master)
        await s.create_tenant("alice")
        await fill(s, "alice", 2)
        await s.flush(upload_timeout_s=60)  # the registry is up; the rest will not be
        await fill(s, "alice", 2, prefix="late")
        endpoint.stop()
        t0 = time.monotonic()
        await s.close()
        took = time.monotonic() - t0
        assert took < STOP_UPLOAD_TIMEOUT_S, f"close waited {took:.1f} s for a tier that is down"
        assert "are not in the object tier after" in caplog.text
        # Sealed locally, queued again at the next start.
        endpoint.start()
        s2 = await Store.open(cfg, master)
        try:
            await s2.flush(upload_timeout_s=60)
            assert all(p == Phase.MIRRORED for p in phases(s2, "alice"))
        finally:
            await s2.close()
    finally:
        endpoint.stop()

"""server.py with an S3 bucket (moto's server on 127.0.0.1), configured the way
operators do it (KVSTORE_S3_* and the AWS variables): flush waits for the
uploads, two workers read blocks whose local copies were dropped, and a node
started on an empty disk serves the same blocks to the same tokens."""

from __future__ import annotations

import asyncio
import random
import shutil
import time

import aiohttp

from tests.http import test_daemon
from tests.http.conftest import ADMIN, Daemon
from tests.http.test_daemon import _ready
from tests.integration.test_g4 import new_bucket
from tests.moto_s3 import AWS_ENV, S3Env

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


def _s3_env(daemon: Daemon, s3: S3Env, bucket: str) -> None:
    daemon.env.update(
        {
            "KVSTORE_S3_ENDPOINT": s3.url,
            "KVSTORE_S3_BUCKET": bucket,
            "KVSTORE_S3_PREFIX": "prod/node-1",
            "KVSTORE_CAPACITY": "16MiB",
            "KVSTORE_HIGH_WATERMARK": "2",  # every mirrored copy is dropped
            "KVSTORE_LOW_WATERMARK": "1",
            **AWS_ENV,
        }
    )


async def test_daemon_mirrors_drops_and_rebuilds(daemon: Daemon, s3: S3Env) -> None:
    _s3_env(daemon, s3, new_bucket(s3.url))
    daemon.extra = ["--workers", "2"]
    daemon.start()
    blocks = {f"b{i:02d}": random.Random(i).randbytes(150_000) for i in range(12)}
    async with aiohttp.ClientSession() as session:
        await _ready(daemon.base, session)
        body = {"name": "t", "durability": "sometimes"}
        async with session.post(daemon.base + "/v1/admin/tenants", json=body, headers=ADMIN_H) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["code"] == "invalid_input" and "durability" in err["message"]
        body["durability"] = "persistent"
        async with session.post(daemon.base + "/v1/admin/tenants", json=body, headers=ADMIN_H) as r:
            assert r.status == 201
            created = await r.json()
            assert created["durability"] == "persistent"
        auth = {"Authorization": f"Bearer {created['token']}"}
        for k, v in blocks.items():
            async with session.put(f"{daemon.base}/v1/blocks/{k}", data=v, headers=auth) as r:
                assert r.status in (200, 201), await r.text()
        async with session.post(daemon.base + "/v1/admin/flush?timeout_s=soon", headers=ADMIN_H) as r:
            assert r.status == 400 and "timeout_s" in (await r.json())["error"]["message"]
        async with session.post(daemon.base + "/v1/admin/flush?timeout_s=60", headers=ADMIN_H) as r:
            assert r.status == 200, await r.text()
            assert await r.json() == {"flushed": True, "tier": "mirrored"}
        seg_dir = daemon.data_dir / "segments" / "t"
        deadline = time.monotonic() + 30
        while list(seg_dir.glob("*.seg")):
            assert time.monotonic() < deadline, "the evictor did not drop the mirrored copies"
            await asyncio.sleep(0.2)
        for _ in range(2):  # both workers serve them
            for k, v in blocks.items():
                async with session.get(f"{daemon.base}/v1/blocks/{k}", headers=auth) as r:
                    assert r.status == 200 and await r.read() == v
        async with session.get(f"{daemon.base}/v1/blocks/b03", headers={**auth, "Range": "bytes=1000-1999"}) as r:
            assert r.status == 206 and await r.read() == blocks["b03"][1000:2000]
        async with session.get(daemon.base + "/metrics") as r:
            text = await r.text()
            assert "kvstore_disk_used_bytes" in text and "kvstore_tier_segments" in text
    assert daemon.stop() == 0

    # The disk is lost; a new node on the same bucket and master key.
    shutil.rmtree(daemon.data_dir)
    daemon.extra = []
    daemon.start()
    async with aiohttp.ClientSession() as session:
        await _ready(daemon.base, session)
        for k, v in blocks.items():
            async with session.get(f"{daemon.base}/v1/blocks/{k}", headers=auth) as r:
                assert r.status == 200 and await r.read() == v
        async with session.get(daemon.base + "/metrics") as r:
            text = await r.text()
            assert "kvstore_tier_reads_total" in text
    assert daemon.stop() == 0
    assert (daemon.data_dir / "registry.json").exists()


def test_workers_with_a_bucket_do_not_outlive_a_killed_supervisor(daemon: Daemon, s3: S3Env) -> None:
    """The supervisor is killed while the reader still opens its store (the
    S3 set-up makes that window wide): the reader must not serve on, orphaned."""
    _s3_env(daemon, s3, new_bucket(s3.url))
    test_daemon.test_workers_do_not_outlive_a_killed_supervisor(daemon)

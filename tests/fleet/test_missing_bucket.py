"""A fleet node whose bucket does not exist says so in one line at start-up,
naming the bucket and the endpoint, and exits 2 (a bad setting), instead of
taking the missing bucket for an empty one.

Regression: S3's answer to a GET in a missing bucket is a 404 (code
NoSuchBucket), which the S3 tier read as "no such object": the node took
the bucket for a new fleet's, then failed at its first write of the
registry or the members with a message naming an object, not the bucket;
a conditional write's 404 even read as a lost race, to be redone."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvstore.errors import BucketNotFound
from kvstore.tier.s3 import S3Tier

from ..http.conftest import ROOT, daemon_env, free_port
from ..moto_s3 import AWS_ENV, S3Env


async def test_the_s3_tier_tells_a_missing_bucket_from_a_missing_object(s3: S3Env) -> None:
    there = S3Tier(s3.bucket, prefix=f"t-{uuid.uuid4().hex[:8]}", endpoint_url=s3.url, path_style=True)
    gone = S3Tier(f"no-such-{uuid.uuid4().hex[:8]}", endpoint_url=s3.url, path_style=True)
    try:
        assert await there.get("fleet/registry.json") is None  # no object: None
        with pytest.raises(BucketNotFound, match="the bucket does not exist"):
            await gone.get("fleet/registry.json")
        with pytest.raises(BucketNotFound):
            await gone.put_if("fleet/members.json", b"{}", None)  # not a conflict to redo
        with pytest.raises(BucketNotFound):
            await gone.put_if("fleet/members.json", b"{}", "0123")
    finally:
        await there.close()
        await gone.close()


def test_a_fleet_node_without_its_bucket_says_so_in_one_line(tmp_path: Path, s3: S3Env) -> None:
    bucket = f"no-such-{uuid.uuid4().hex[:8]}"
    settings = {"fleet": "1", "node_id": "node-0", "s3_bucket": bucket, "s3_endpoint": s3.url, "s3_prefix": "f"}
    env = daemon_env(tmp_path, **settings) | AWS_ENV
    port = free_port()
    cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(tmp_path / "data")]
    out = subprocess.run([*cmd, "--listen", f"127.0.0.1:{port}"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    said = [line for line in out.stderr.splitlines() if bucket in line]
    assert said == [
        f"kvstore: s3_bucket={bucket!r}: no such bucket at s3_endpoint={s3.url!r}; "
        "a fleet's nodes do not create their bucket: create it, then start them"
    ], out.stderr
    assert "Traceback" not in out.stderr, out.stderr

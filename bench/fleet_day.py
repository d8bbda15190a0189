"""kvstore-bench fleet-day: a fleet node's day of a trickle, in the bucket.

A tenant writing a trickle on a fleet node seals a segment every
``seal_after_s`` (10 s): 8,640 small sealed segments a day, each an object
in the node's prefix of the bucket, and each a footer a survivor reads when
it takes the node over. This builds such a prefix for real (a store on
moto's S3 server, or ``--endpoint``: one block put and one flush per
segment, ``--segments`` of them), then measures:

- the objects in the prefix, and a survivor's takeover time (a read-only
  follower store opened on the prefix, as kvstore/fleet/takeover.py opens
  one: every footer read and indexed), before merging;
- the compaction passes that merge the small segments (``merge_below``):
  their time and what they copied;
- the objects and the takeover time after.

    kvstore-bench fleet-day --segments 8640 --json day.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

HELP = "a fleet node's day of a trickle: bucket objects and takeover time before and after merging"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore-bench fleet-day", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--segments", type=int, default=8640, help="small sealed segments to make (default 8640: a day at 10 s)"
    )
    p.add_argument(
        "--block-bytes", type=int, default=16 << 10, help="the block written before each seal (default 16 KiB)"
    )
    p.add_argument("--endpoint", help="an S3 endpoint with --bucket (default: moto's server, started here)")
    p.add_argument("--bucket", help="the bucket (with --endpoint; it must exist)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p


async def _run(args: argparse.Namespace, endpoint: str, bucket: str) -> dict[str, Any]:
    from kvstore.config import StoreConfig
    from kvstore.engine.api import MasterKey, Store, node_prefix

    work = Path(tempfile.mkdtemp(prefix="fleet-day-"))
    master = MasterKey(os.urandom(32))
    fleet_prefix = f"day-{uuid.uuid4().hex[:8]}"
    node = StoreConfig.from_env(
        work / "node",
        env={},
        s3_bucket=bucket,
        s3_endpoint=endpoint,
        compact_interval_s="0",  # passes run here, measured
    )
    node = replace(node, s3_prefix=f"{fleet_prefix}/{node_prefix('node-x')}")
    survivor = StoreConfig.from_env(work / "survivor", env={}, s3_bucket=bucket, s3_endpoint=endpoint)
    survivor = replace(survivor, s3_prefix=fleet_prefix, node_id="node-y")
    out: dict[str, Any] = {"segments": args.segments, "block_bytes": args.block_bytes}
    store = await Store.open(node, master)
    try:
        await store.create_tenant("trickle")
        t0 = time.monotonic()
        for i in range(args.segments):
            await store.put("trickle", f"b{i:06d}", os.urandom(args.block_bytes))
            await store.flush(upload_timeout_s=60)
            if (i + 1) % 500 == 0:
                print(f"  {i + 1} segments sealed and uploaded ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        out["build_s"] = round(time.monotonic() - t0, 1)
        out["objects_before"] = await _objects(store)
        out["takeover_before_s"] = await _takeover(survivor, master, work / "adopted-1")
        t0 = time.monotonic()
        passes = []
        while True:
            report = await store.compact("trickle")
            await store.flush(upload_timeout_s=600)
            passes.append(report.as_dict())
            if not report.segments_merged and not report.objects_deleted:
                break
        out["merge_s"] = round(time.monotonic() - t0, 1)
        out["merge_passes"] = passes
        out["objects_after"] = await _objects(store)
        out["takeover_after_s"] = await _takeover(survivor, master, work / "adopted-2")
    finally:
        await store.close()
    return out


async def _objects(store: Any) -> int:
    return len([o async for o in store.tier.list("segments/")])


async def _takeover(survivor: Any, master: Any, where: Path) -> float:
    """A survivor's takeover of node-x: its prefix opened as a read-only follower (takeover.py)."""
    from kvstore.engine.api import Store
    from kvstore.fleet.takeover import adopted_config

    t0 = time.monotonic()
    store = await Store.open(adopted_config(survivor, "node-x", where), master)
    took = time.monotonic() - t0
    try:
        assert store.tenant_names() == ["trickle"], store.tenant_names()
    finally:
        await store.close()
    return round(took, 2)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if bool(args.endpoint) != bool(args.bucket):
        print("kvstore-bench fleet-day: --endpoint and --bucket go together", file=sys.stderr)
        return 2
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    server = None
    endpoint, bucket = args.endpoint, args.bucket
    if endpoint is None:
        from .moto_s3 import ensure_bucket, start

        server, endpoint = start()
        bucket = f"fleet-day-{uuid.uuid4().hex[:8]}"
        ensure_bucket(endpoint, bucket)
    try:
        out = asyncio.run(_run(args, endpoint, bucket))
    finally:
        if server is not None:
            server.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

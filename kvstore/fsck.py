"""Offline check of a data directory. It only reads, unless told to repair.

    kvstore fsck --data-dir DIR [--config FILE] [--shallow] [--repair]

Runs with the daemon stopped (the store's lock refuses a second process).

Without ``--repair`` nothing is written: not a segment, not the index, not
the registry, nothing in the object tier. It reports what recovery would do at
the next start (``plan``: torn tails it would cut, segments it would index or
seal, leftovers it would remove, tenants it would refuse to start with) and
scrubs every segment (``verify``: headers, footers, checksums; and every frame
opened, GCM tag and zstd, unless ``--shallow``).

With ``--repair`` it opens the store, which runs recovery (the repairs the
plan lists), then scrubs. Even then it starts no background work (no uploads,
evictions or compaction) and talks to no object tier: the index's record of
what the tier holds is trusted as it is.

Prints JSON; exits 0 when nothing is wrong (a plan with nothing to do and a
clean scrub), 1 when something is, 2 on a start-up error (a wrong master key
is refused, never reported as clean). Settings are loaded as the daemon
loads them (``--config`` or ``$KVSTORE_CONFIG``, then ``KVSTORE_*``
variables; an unknown one is refused), so a repair recovers with the
daemon's durability, segment and tenant settings; the master key comes from
them too (``master_key_file``, KVSTORE_MASTER_KEY_FILE or
KVSTORE_MASTER_KEY).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey, load_master_key
from kvstore.engine.index import SEG_OPEN, SEG_RETIRED, Index
from kvstore.engine.recovery import TRASH, tenant_dirs
from kvstore.engine.registry import Registry
from kvstore.engine.segment import SegmentFile, parse_segment_name
from kvstore.engine.store import Store
from kvstore.engine.verify import verify_segments
from kvstore.errors import CorruptionError, IndexUnusable, KVStoreError, StoreLocked
from kvstore.server_config import load


def _locked(root: Path) -> int:
    """Hold the store's lock, so the daemon cannot start meanwhile (-1: the
    store never had one)."""
    if not root.is_dir():
        raise KVStoreError(f"data directory {str(root)!r} does not exist")
    try:
        fd = os.open(root / "LOCK", os.O_RDONLY)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLocked(f"data directory {str(root)!r} is in use by another process") from None
    return fd


def plan(root: Path, registry: Registry, index: Index | None) -> dict[str, Any]:
    """What recovery would change at the next start, found by reading only."""
    seg_root = root / "segments"
    out: dict[str, Any] = {
        "index_missing": index is None,
        "unknown_tenants": [],
        "deleted_tenants_left": [],
        "trash": (seg_root / TRASH).exists(),
        "missing_segments": [],
        "unindexed_segments": [],
        "torn_tails": [],
        "abandoned_open_segments": [],
        "retired_left": [],
    }
    for name in sorted(tenant_dirs(seg_root) - set(registry.names())):
        key = "deleted_tenants_left" if registry.was_deleted(name) else "unknown_tenants"
        out[key].append(name)
    for tenant in registry.names():
        d = seg_root / tenant
        files = {sid: p for p in (d.iterdir() if d.is_dir() else ()) if (sid := parse_segment_name(p.name)) is not None}
        known = index.segments(tenant) if index is not None else {}
        tiers = index.tier_states() if index is not None else {}
        for sid, state in sorted(known.items()):
            where = f"{tenant}/{sid:016x}.seg"
            ts = tiers.get((tenant, sid))
            if state.state == SEG_RETIRED:
                if sid in files:
                    out["retired_left"].append(where)
            elif sid not in files and not (ts is not None and ts.mirrored):
                out["missing_segments"].append(where)
        newest = max(files, default=None)
        for sid, path in sorted(files.items()):
            where = f"{tenant}/{path.name}"
            st = known.get(sid)
            if st is None:
                out["unindexed_segments"].append(where)
                continue
            if st.state != SEG_OPEN:
                continue
            try:
                seg = SegmentFile.open(path)
            except (CorruptionError, OSError) as e:
                out["torn_tails"].append({"segment": where, "error": str(e)})
                continue
            try:
                if seg.sealed:
                    continue  # sealed after the index last heard: indexed from its footer
                if sid != newest:
                    out["abandoned_open_segments"].append(where)
                for item in seg.scan(st.indexed_upto, verify_from=st.synced_upto):
                    if item.error is not None:
                        out["torn_tails"].append(
                            {"segment": where, "offset": item.offset, "bytes": seg.size - item.offset}
                        )
                        break
            finally:
                seg.close()
    return out


def _plan_clean(p: dict[str, Any]) -> bool:
    return not any(v for k, v in p.items() if k != "index_missing")


async def check(data_dir: str, master: MasterKey, deep: bool) -> tuple[int, dict[str, Any]]:
    root = Path(data_dir)
    fd = _locked(root)
    try:
        reg_path = root / "registry.json"
        if not reg_path.exists():
            present = sorted(tenant_dirs(root / "segments"))
            doc: dict[str, Any] = {"mode": "check", "registry": "missing", "tenants_with_data": present}
            return (1 if present else 0), doc
        registry = Registry(reg_path, master, readonly=True)
        index: Index | None = None
        if (root / "index" / "data.mdb").exists():
            try:
                index = Index(root / "index", readonly=True, lock=False)
            except IndexUnusable as e:
                return 1, {"mode": "check", "index": f"unusable ({e}): the next start rebuilds it"}
        try:
            p = plan(root, registry, index)
            verify = verify_segments(root / "segments", registry, index, deep)
        finally:
            if index is not None:
                index.close()
        doc = {"mode": "check", "plan": p, "verify": verify.as_dict()}
        return (0 if _plan_clean(p) and verify.ok else 1), doc
    finally:
        if fd >= 0:
            os.close(fd)


async def repair(config: StoreConfig, master: MasterKey, deep: bool) -> tuple[int, dict[str, Any]]:
    """Recovery as the daemon runs it, with the daemon's settings (``config``)
    but no object tier and no background work."""
    cfg = config.with_(s3_bucket="", tier_dir="", s3_readonly=False, compact_interval_s=0)
    store = await Store.open(cfg, master, background=False)
    try:
        report = await store.verify(deep=deep)
        doc = {"mode": "repair", "recovery": store.recovery.as_dict(), "verify": report.as_dict()}
        return (0 if report.ok else 1), doc
    finally:
        await store.close()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="the data directory of a stopped daemon (its data_dir)")
    p.add_argument(
        "--config", help="the daemon's TOML settings (default: $KVSTORE_CONFIG); its KVSTORE_* variables apply too"
    )
    p.add_argument("--shallow", action="store_true", help="do not open frames (no GCM/zstd check)")
    p.add_argument("--repair", action="store_true", help="run recovery (it writes), then check")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load(args.config, os.environ, {"data_dir": args.data_dir})  # as the daemon loads them
        master = load_master_key(cfg.master_key_file, cfg.master_key)
        if args.repair:
            rc, doc = asyncio.run(repair(cfg.store, master, not args.shallow))
        else:
            rc, doc = asyncio.run(check(args.data_dir, master, not args.shallow))
    except KVStoreError as e:
        print(f"kvstore fsck: {e}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""``kvstore fsck``: an offline check of a data directory; it only reads, unless told to repair.

    kvstore fsck --data-dir DIR [--config FILE] [--shallow] [--repair [--as-owner]] [--json]

Runs with the daemon stopped (the store's lock refuses a second process).

Without ``--repair`` nothing is written: not a segment, not the index, not
the registry, nothing in the object tier. It reports what recovery would do at
the next start (``plan``: torn tails it would cut, segments it would index or
seal, leftovers it would remove, tenants it would refuse to start with),
scrubs every segment (``verify``: headers, footers, checksums; and every frame
opened, GCM tag and zstd, unless ``--shallow``), and lists what in the
directory its owner does not own (``not_owned``: the daemon, running as the
owner, may not be able to write it).

With ``--repair`` it opens the store, which runs recovery (the repairs the
plan lists), then scrubs. Even then it starts no background work (no uploads,
evictions or compaction) and talks to no object tier: the index's record of
what the tier holds is trusted as it is. A repair writes only as the data
directory's owner: run by another user it is refused, unless that user is
root and passes ``--as-owner``, and then the process becomes the owner (its
uid, its account's groups) before it reads the master key or touches the
directory. So every file it makes or rewrites is the owner's, with the modes
the daemon gives them, and a link planted in the directory leads it nowhere
the owner could not go. (Chowning afterwards, the other way, would leave
root-owned files behind whenever a repair stopped half-way, and would have
root write through whatever links the directory holds.)

A directory that is not a data directory (missing, empty, or without any of
registry.json, index/ and segments/) is refused with one line (exit 2):
never reported clean, never made into a new store by a repair.

Prints a summary for people, or JSON with ``--json``; exits 0 when nothing is
wrong (a plan with nothing to do, a clean scrub, every file the owner's), 1
when something is, 2 when it cannot check (a start-up error: a bad setting,
a wrong master key is refused, never reported as clean; not a data
directory; a repair refused). Settings are loaded as the daemon loads them
(``--config`` or ``$KVSTORE_CONFIG``, then ``KVSTORE_*`` variables; an
unknown one is refused), so a repair recovers with the daemon's durability,
segment and tenant settings; the master key comes from them too
(``master_key_file``, KVSTORE_MASTER_KEY_FILE or KVSTORE_MASTER_KEY).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import pwd
import sys
from pathlib import Path
from typing import Any

from kvstore import logs
from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey, load_master_key
from kvstore.engine.index import SEG_OPEN, SEG_RETIRED, Index
from kvstore.engine.recovery import TRASH, tenant_dirs
from kvstore.engine.registry import Registry
from kvstore.engine.segment import SegmentFile, parse_segment_name
from kvstore.engine.store import Store
from kvstore.engine.verify import verify_segments
from kvstore.errors import CorruptionError, IndexUnusable, KVStoreError, StoreLocked
from kvstore.fsck_summary import summary
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


MARKERS = ("registry.json", "index", "segments")


def data_directory(root: Path) -> None:
    """Refuse, with one line, what is not a kvstore data directory: a path
    that does not exist or is not a directory, or one with none of
    :data:`MARKERS` (empty, or something else: a mistyped --data-dir)."""
    if not root.exists():
        raise KVStoreError(f"data directory {str(root)!r} does not exist")
    if not root.is_dir():
        raise KVStoreError(f"{str(root)!r} is not a directory, let alone a kvstore data directory")
    if not any((root / name).exists() for name in MARKERS):
        what = "is empty" if not any(root.iterdir()) else "has none of registry.json, index/ and segments/"
        raise KVStoreError(
            f"{str(root)!r} is not a kvstore data directory: it {what} (is --data-dir the daemon's data_dir?)"
        )


def _account(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _sudo_user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"'#{uid}'"


def repair_as_owner(root: Path, as_owner: bool) -> None:
    """A repair writes only as ``root``'s owner (module doc): return if this
    process is the owner; refuse if not, unless ``as_owner`` and this
    process is root, which then becomes the owner for good."""
    st = root.stat()
    me = os.geteuid()
    if st.st_uid == me:
        return
    owner = _account(st.st_uid)
    if not as_owner:
        raise KVStoreError(
            f"data directory {str(root)!r} belongs to {owner}, not {_account(me)}: a repair would leave files the"
            f" daemon cannot write; run it as that user (sudo -u {_sudo_user(st.st_uid)} kvstore fsck ...)"
            " or, as root, add --as-owner"
        )
    if me != 0:
        raise KVStoreError(f"--as-owner: only root can act as {owner}, the owner of {str(root)!r}")
    become(st.st_uid, st.st_gid)


def become(uid: int, gid: int) -> None:
    """Act as user ``uid`` from now on, in its account's groups (``gid``
    alone where it has no account), as the daemon run by that user would."""
    try:
        pw = pwd.getpwuid(uid)
        gid, groups = pw.pw_gid, os.getgrouplist(pw.pw_name, pw.pw_gid)
    except KeyError:
        groups = [gid]
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)  # as root: real, effective and saved ids, so there is no way back


def not_owned(root: Path) -> dict[str, Any]:
    """Paths under ``root`` (relative) that ``root``'s owner does not own."""
    owner = root.stat().st_uid
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            try:
                if os.lstat(path).st_uid != owner:
                    paths.append(os.path.relpath(path, root))
            except FileNotFoundError:
                continue
    return {"owner_uid": owner, "paths": sorted(paths)}


DESCRIPTION = """\
Check a stopped daemon's data directory offline (and --repair it).

It reports what recovery would do at the next start (torn tails to cut,
segments to index or seal, leftovers to remove, tenants it would refuse to
start with), checks every segment's headers, footers and checksums, opens
every frame (unless --shallow), and lists files the directory's owner does
not own. It writes nothing unless given --repair.

Run it as the daemon's user, with the daemon's settings (the same --config,
KVSTORE_* variables and master key), for example:
  sudo -u kvstore env KVSTORE_MASTER_KEY_FILE=/etc/kvstore/master.key \\
      /opt/kvstore/.venv/bin/kvstore fsck --data-dir /var/lib/kvstore"""

EPILOG = """\
--repair opens the store, which runs recovery with the daemon's settings (no
object tier, no background work), then checks. It writes only as the data
directory's owner: another user is refused, and root may pass --as-owner to
become the owner (its uid and groups) before it reads or writes anything.

exit status:
  0   clean: nothing for recovery to do, every record sound, every file the
      owner's
  1   something is wrong: the summary (or --json) says what
  2   it could not check: not a kvstore data directory, a bad setting, a wrong
      master key, the daemon still running, a repair refused; one line on
      stderr says which"""


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--data-dir", required=True, metavar="DIR", help="the data directory of a stopped daemon (its data_dir)"
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="the daemon's TOML settings (default: $KVSTORE_CONFIG); its KVSTORE_* variables apply too",
    )
    p.add_argument("--shallow", action="store_true", help="do not open frames (no GCM/zstd check): faster")
    p.add_argument(
        "--repair", action="store_true", help="run recovery (it writes, as the directory's owner), then check"
    )
    p.add_argument(
        "--as-owner",
        action="store_true",
        help="with --repair, run as root: become the data directory's owner (uid and groups) first",
    )
    p.add_argument("--json", action="store_true", help="print the full report as JSON instead of a summary")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = parser(prog)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.as_owner and not args.repair:
        p.error("--as-owner applies to --repair only (a check writes nothing, whoever runs it)")
    logs.setup("warning", "text")  # what recovery warns of, on stderr; the report goes to stdout
    root = Path(args.data_dir)
    try:
        data_directory(root)
        if args.repair:
            repair_as_owner(root, args.as_owner)  # before anything is read or written
        cfg = load(args.config, os.environ, {"data_dir": args.data_dir})  # as the daemon loads them
        master = load_master_key(cfg.master_key_file, cfg.master_key)
        if args.repair:
            rc, doc = asyncio.run(repair(cfg.store, master, not args.shallow))
        else:
            rc, doc = asyncio.run(check(args.data_dir, master, not args.shallow))
        doc["not_owned"] = not_owned(root)
    except KVStoreError as e:
        print(f"kvstore fsck: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the host's doing: one line, as for a bad setting
        where = f": {e.filename!r}" if e.filename is not None else ""
        hint = " (run kvstore fsck without --repair to list files the owner does not own)" if args.repair else ""
        print(f"kvstore fsck: {e.strerror or type(e).__name__}{where}{hint}", file=sys.stderr)
        return 2
    if doc["not_owned"]["paths"]:
        rc = max(rc, 1)
    print(json.dumps(doc, indent=2) if args.json else summary(root, doc, rc))
    return rc


if __name__ == "__main__":
    sys.exit(main())

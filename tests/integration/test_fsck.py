"""kvstore.fsck: the offline scrub as operators run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvstore.engine.store import Store

ROOT = Path(__file__).resolve().parents[2]


def _fsck(data_dir: Path, key: bytes, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVSTORE_MASTER_KEY": key.hex(), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "kvstore.fsck", "--data-dir", str(data_dir), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


async def test_fsck_clean_then_corrupt(store: Store) -> None:
    await store.put("alice", "k", os.urandom(100_000))
    await store.put("alice", "k2", os.urandom(100_000))
    key = store._master.secret
    data_dir = store.config.data_dir
    await store.close()
    ok = _fsck(data_dir, key)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["verify"]["records"] == 2
    seg = data_dir / "segments" / "alice" / "0000000000000001.seg"
    raw = bytearray(seg.read_bytes())
    raw[4096 + 3000] ^= 0xFF
    seg.write_bytes(raw)
    bad = _fsck(data_dir, key)
    assert bad.returncode == 1
    errors = json.loads(bad.stdout)["verify"]["errors"]
    assert errors and errors[0]["segment"] == "alice/0000000000000001.seg" and errors[0]["offset"] == 4096
    assert _fsck(data_dir, os.urandom(32)).returncode == 2  # wrong master key: refused, not "clean"


def _tree(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``root``: size, mtime and a digest of its bytes."""
    import hashlib

    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).digest())
    return out


async def test_fsck_repaired_although_asked_only_to_check(store: Store) -> None:
    """fsck used to run recovery (truncating tails, deleting directories,
    starting the mirror) although operators run a checker expecting it to
    look only. Now it writes nothing unless given --repair."""
    await store.put("alice", "k", os.urandom(50_000))
    key = store._master.secret
    data_dir = store.config.data_dir
    await store.close()
    seg = data_dir / "segments" / "alice" / "0000000000000001.seg"
    with seg.open("ab") as f:  # a torn tail, as a crash mid-batch leaves it
        f.write(b"KVR1" + os.urandom(5000))
    (data_dir / "segments" / "ghost").mkdir()  # a tenant the registry does not know
    before = _tree(data_dir)
    out = _fsck(data_dir, key)
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert doc["mode"] == "check"
    assert doc["plan"]["unknown_tenants"] == ["ghost"]
    assert doc["plan"]["torn_tails"][0]["segment"] == "alice/0000000000000001.seg"
    assert _tree(data_dir) == before, "a check changed the data directory"
    (data_dir / "segments" / "ghost").rmdir()
    fixed = _fsck(data_dir, key, "--repair")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert json.loads(fixed.stdout)["recovery"]["truncated"]
    assert _fsck(data_dir, key).returncode == 0


async def test_fsck_repair_ignored_the_daemons_settings(store: Store, tmp_path: Path) -> None:
    """fsck --repair used to run recovery with default settings, whatever the
    daemon's TOML file said (durability, segment sizes, what to do with
    unknown tenants). It now loads them as the daemon does: --config (or
    $KVSTORE_CONFIG), then KVSTORE_* variables, an unknown one refused."""
    await store.put("alice", "k", os.urandom(10_000))
    key = store._master.secret
    data_dir = store.config.data_dir
    await store.close()
    (data_dir / "segments" / "ghost").mkdir()  # a tenant the registry does not know
    refused = _fsck(data_dir, key, "--repair")
    assert refused.returncode == 2 and "ghost" in refused.stderr, refused.stderr
    toml = tmp_path / "kvstore.toml"
    toml.write_text("discard_unknown_tenants = true\nsegment_size = '4MiB'\n")
    fixed = _fsck(data_dir, key, "--repair", "--config", str(toml))
    assert fixed.returncode == 0, fixed.stderr
    assert "ghost" in json.loads(fixed.stdout)["recovery"]["orphans_removed"]
    assert not (data_dir / "segments" / "ghost").exists()
    env = {**os.environ, "KVSTORE_MASTER_KEY": key.hex(), "PYTHONPATH": str(ROOT), "KVSTORE_DURABLITY": "interval"}
    cmd = [sys.executable, "-m", "kvstore.fsck", "--data-dir", str(data_dir)]
    typo = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and "KVSTORE_DURABILITY" in typo.stderr, typo.stderr

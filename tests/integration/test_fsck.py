"""kvstore.fsck: the offline scrub as operators run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvstore.store import Store

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

"""kvstore.fsck: the offline scrub as operators run it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.store import Store
from tests.http.conftest import ADMIN, free_port
from tests.polling import until

ROOT = Path(__file__).resolve().parents[2]


def _fsck(data_dir: Path, key: bytes, *args: str, as_json: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVSTORE_MASTER_KEY": key.hex(), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "kvstore.fsck", "--data-dir", str(data_dir), *args, *(["--json"] if as_json else [])]
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
    cmd = [sys.executable, "-m", "kvstore.fsck", "--data-dir", str(data_dir), "--json"]
    typo = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and "KVSTORE_DURABILITY" in typo.stderr, typo.stderr


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


async def test_fsck_printed_json_only(store: Store) -> None:
    """fsck printed a JSON document whatever asked; people now get a summary
    (what was checked, what is wrong, the exit status) and scripts --json."""
    await store.put("alice", "k", os.urandom(100_000))
    key = store._master.secret
    data_dir = store.config.data_dir
    await store.close()
    ok = _fsck(data_dir, key, as_json=False)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert lines[0] == f"kvstore fsck: {data_dir}: checked; nothing written"
    assert "  at the next start: nothing to do" in lines and "  damaged records: none" in lines
    assert "1 segment, 1 record" in ok.stdout and "frames opened" in ok.stdout
    assert lines[-1] == "clean (exit status 0)"
    seg = data_dir / "segments" / "alice" / "0000000000000001.seg"
    raw = bytearray(seg.read_bytes())
    raw[4096 + 3000] ^= 0xFF
    seg.write_bytes(raw)
    bad = _fsck(data_dir, key, as_json=False)
    assert bad.returncode == 1
    assert "  damaged records: 1" in bad.stdout.splitlines()
    assert "    alice/0000000000000001.seg at offset 4096: " in bad.stdout
    assert bad.stdout.splitlines()[-1] == "1 problem found (exit status 1); --json gives the full report"


def test_fsck_on_a_directory_that_is_no_data_directory_said_clean(tmp_path: Path) -> None:
    """fsck on an empty or mistyped directory exited 0 ('registry': 'missing'),
    and --repair made a new store there. Now: exit 2, one line saying what
    the path is, and nothing written."""
    key = os.urandom(32)
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "home"  # someone's directory, not a store
    other.mkdir()
    (other / "notes.txt").write_text("not a store")
    (other / "data").mkdir()
    plain = tmp_path / "file"
    plain.write_text("x")
    cases = [
        (tmp_path / "missing", "does not exist"),
        (empty, "is not a kvstore data directory: it is empty"),
        (other, "is not a kvstore data directory: it has none of registry.json, index/ and segments/"),
        (plain, "is not a directory"),
    ]
    for i, (path, why) in enumerate(cases):
        for args in ((), ("--repair",) if i % 2 else ("--repair", "--json")):
            out = _fsck(path, key, *args, as_json=False)
            assert out.returncode == 2 and out.stdout == "", (path, args, out)
            line = _one_line(out.stderr)
            assert line.startswith("kvstore fsck: ") and why in line, line
    assert list(empty.iterdir()) == []  # the repair made no store of it
    assert sorted(p.name for p in other.iterdir()) == ["data", "notes.txt"]
    assert not (tmp_path / "missing").exists()


NOBODY = 65534
# Python lives under /root (0700) on some machines: the capability to read
# and search every file lets uid 65534 run the interpreter, and nothing else:
# every write still needs the owner's permission, which is what is tested.
AS_NOBODY = [
    "setpriv",
    f"--reuid={NOBODY}",
    f"--regid={NOBODY}",
    "--clear-groups",
    "--inh-caps=+dac_read_search",
    "--ambient-caps=+dac_read_search",
]


def _owners(root: Path) -> set[tuple[int, int]]:
    return {(p.lstat().st_uid, p.lstat().st_gid) for p in [root, *root.rglob("*")]}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a data directory is given to uid 65534 and repaired as root")
@pytest.mark.skipif(
    shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to start the daemon as uid 65534"
)
async def test_repair_as_root_left_a_store_the_daemon_could_not_open(tmp_path: Path) -> None:
    """`kvstore fsck --repair` run as root rebuilt the index as root-owned
    files; the daemon, running as the data's owner, said it would rebuild the
    index, then exited 2 on 'Permission denied'. Now a repair by anyone but
    the directory's owner is refused with one line (nothing written); root
    passes --as-owner to act as the owner, everything stays the owner's, and
    the daemon started as the owner serves the repaired store. A check lists
    files the owner does not own."""
    base = Path(tempfile.mkdtemp(prefix="kvstore-fsck-owner-", dir="/tmp"))  # pytest's tmp is root's, 0700
    try:
        data_dir = base / "data"
        key = os.urandom(32)
        key_file = base / "master.key"
        key_file.write_bytes(key)
        key_file.chmod(0o600)
        block = os.urandom(200_000)
        settings = {"segment_size": "1MiB", "frame_size": "64KiB"}
        store = await Store.open(StoreConfig.from_env(data_dir, env={}, **settings), MasterKey(key))
        await store.create_tenant("alice")
        _, token = await store.issue_token("alice")
        await store.put("alice", "k", block)
        await store.close()
        shutil.rmtree(data_dir / "index")  # recovery rebuilds it: new files, as in the report
        seg = data_dir / "segments" / "alice" / "0000000000000001.seg"
        with seg.open("ab") as f:  # and a torn tail to cut: a file rewritten
            f.write(b"KVR1" + os.urandom(5000))
        for p in [base, *base.rglob("*")]:
            os.chown(p, NOBODY, NOBODY)
        before = _tree(data_dir)

        refused = _fsck(data_dir, key, "--repair", as_json=False)
        assert refused.returncode == 2 and refused.stdout == ""
        line = _one_line(refused.stderr)
        assert f"belongs to nobody (uid {NOBODY}), not root (uid 0)" in line, line
        assert "sudo -u nobody kvstore fsck" in line and "--as-owner" in line, line
        assert _tree(data_dir) == before, "a refused repair wrote"
        assert _owners(base) == {(NOBODY, NOBODY)}

        fixed = _fsck(data_dir, key, "--repair", "--as-owner")
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr
        doc = json.loads(fixed.stdout)
        assert doc["recovery"]["index_rebuilt"] and doc["recovery"]["truncated"]
        assert doc["not_owned"] == {"owner_uid": NOBODY, "paths": []}
        assert (data_dir / "index" / "data.mdb").exists()
        assert _owners(base) == {(NOBODY, NOBODY)}, sorted(
            str(p) for p in base.rglob("*") if p.lstat().st_uid != NOBODY
        )

        port = free_port()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(ROOT),
            "KVSTORE_ADMIN_TOKEN": ADMIN,
            "KVSTORE_MASTER_KEY_FILE": str(key_file),
            "KVSTORE_WORKERS": "1",
            "KVSTORE_SEGMENT_SIZE": settings["segment_size"],
            "KVSTORE_FRAME_SIZE": settings["frame_size"],
        }
        cmd = [*AS_NOBODY, sys.executable, str(ROOT / "server.py"), "--data-dir", str(data_dir)]
        log_path = tmp_path / "server.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen([*cmd, "--listen", f"127.0.0.1:{port}"], env=env, stdout=log, stderr=log)
        try:
            async with aiohttp.ClientSession() as session:

                async def ready() -> bool:
                    assert proc.poll() is None, log_path.read_text()
                    try:
                        async with session.get(f"http://127.0.0.1:{port}/readyz") as r:
                            return r.status == 200
                    except aiohttp.ClientConnectionError:
                        return False

                await until("the daemon, as uid 65534, ready", ready, timeout_s=60)
                headers = {"Authorization": f"Bearer {token}"}
                async with session.get(f"http://127.0.0.1:{port}/v1/blocks/k", headers=headers) as r:
                    assert r.status == 200 and await r.read() == block
                async with session.put(
                    f"http://127.0.0.1:{port}/v1/blocks/k2", data=b"x" * 10_000, headers=headers
                ) as r:
                    assert r.status == 201, await r.text()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log_path.read_text()
        assert _owners(base) == {(NOBODY, NOBODY)}

        # What a root-made file looks like to a check: listed, exit 1.
        os.chown(data_dir / "index" / "data.mdb", 0, 0)
        check = _fsck(data_dir, key)
        assert check.returncode == 1, check.stdout + check.stderr
        assert json.loads(check.stdout)["not_owned"]["paths"] == ["index/data.mdb"]
        summary = _fsck(data_dir, key, as_json=False).stdout
        assert f"chown -R {NOBODY}: {data_dir}" in summary and "    index/data.mdb" in summary
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory of another user")
def test_as_owner_needs_root_and_a_repair(tmp_path: Path) -> None:
    """--as-owner is root's way to act as the owner: refused to anyone
    else (one line), and meaningless without --repair (a usage error)."""
    base = Path(tempfile.mkdtemp(prefix="kvstore-fsck-owner-", dir="/tmp"))
    try:
        base.chmod(0o755)
        data_dir = base / "data"
        (data_dir / "segments").mkdir(parents=True)
        data_dir.chmod(0o755)
        cmd = [*AS_NOBODY, sys.executable, "-m", "kvstore.fsck", "--data-dir", str(data_dir), "--repair", "--as-owner"]
        env = {**os.environ, "KVSTORE_MASTER_KEY": os.urandom(32).hex(), "PYTHONPATH": str(ROOT)}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out
        assert "--as-owner: only root can act as root (uid 0)" in _one_line(out.stderr)
        usage = _fsck(data_dir, os.urandom(32), "--as-owner", as_json=False)
        assert usage.returncode == 2 and "--as-owner applies to --repair only" in usage.stderr
        assert sorted(p.name for p in data_dir.iterdir()) == ["segments"]
    finally:
        shutil.rmtree(base)

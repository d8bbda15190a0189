"""Write the data directory this revision's formats make, for the upgrade test.

    .venv/bin/python tests/data/upgrade/make_fixture.py [--out DIR] [--force]

Starts the real daemon (``server.py``, as an operator would run it) on a new
data directory, with a fixed test master key and small segments, and over
its HTTP API:

- creates two tenants, one ``sealed`` (zstd-bp2, AES-GCM) and one ``direct``;
- puts blocks of deterministic content in each: random bytes (SHAKE-256 of
  a seed: one small, one of three frames), compressible text, and a real KV
  cache slice (``sources/gemma3-270m.bf16.first64KiB.bin``, kept here so the
  fixture does not depend on where bench/data/kv lives);
- flushes (``POST /v1/admin/flush``): every open segment is sealed, with
  its footer;
- rotates the sealed tenant's data key, deletes one block of each tenant
  (a tombstone in the new open segment for a block in the sealed one), and
  puts more blocks, so each tenant also has an open segment (no footer,
  recovery scans it);
- stops the daemon with SIGTERM (a clean close) and writes ``manifest.json``
  (every key's length and sha256, the deleted keys, the tenants' tokens,
  the settings the daemon must be started with) and the key.

The output, ``tests/data/upgrade/vVERSION/`` (VERSION: ``kvstore.__version__``),
is committed and never changed again: tests/integration/test_upgrade_fixture.py
opens a copy of every such directory with the revision under test. Run this
script again, under the new revision, whenever a persisted format changes
(docs/operations.md): it refuses to overwrite a directory that exists.

Left out of the fixture: the store's ``LOCK``, LMDB's ``index/lock.mdb`` and
the space ``reserve`` (each made again at start-up; the reserve is a
preallocated MiB). Nothing here is sparse (segments are written, not
preallocated), so the files' sizes are what git stores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
KV_SOURCE = HERE / "sources" / "gemma3-270m.bf16.first64KiB.bin"
KV_ORIGINS = [ROOT / "bench" / "data" / "kv" / "gemma3-270m.bf16.layers8-9.bin", ROOT / "tests" / "data" / "kv"]
KV_SLICE = 64 << 10
ADMIN = "upgrade-fixture-admin-token-0123456789"  # not stored in the data directory
# A test fixture, committed on purpose: it opens nothing but these directories.
MASTER_KEY = hashlib.sha256(b"kvstore upgrade fixture master key: a test fixture, not a secret").hexdigest()
SETTINGS = {  # KVSTORE_* variables the daemon writes (and must read) the fixture with
    "KVSTORE_SEGMENT_SIZE": "1MiB",
    "KVSTORE_FRAME_SIZE": "64KiB",
    "KVSTORE_WORKERS": "1",
}
LEFT_OUT = ("LOCK", "reserve", "index/lock.mdb", "index.unsynced")
SEALED, DIRECT = "upgrade-sealed", "upgrade-direct"


def seeded(seed: str, n: int) -> bytes:
    """``n`` bytes that look random and are the same on every machine."""
    return hashlib.shake_256(seed.encode()).digest(n)


def text(seed: str, n: int) -> bytes:
    """``n`` bytes of compressible text."""
    line = f"kvstore upgrade fixture {seed}: the quick brown fox jumps over the lazy dog\n".encode()
    return (line * (n // len(line) + 1))[:n]


def kv_slice() -> bytes:
    """The first 64 KiB of a real bf16 KV cache (copied here once)."""
    if not KV_SOURCE.exists():
        origin = next((p for p in KV_ORIGINS if p.is_file()), None)
        if origin is None:
            raise SystemExit(f"no KV sample: expected {KV_SOURCE} or one of {[str(p) for p in KV_ORIGINS]}")
        KV_SOURCE.parent.mkdir(parents=True, exist_ok=True)
        KV_SOURCE.write_bytes(origin.read_bytes()[:KV_SLICE])
    data = KV_SOURCE.read_bytes()
    if len(data) != KV_SLICE:
        raise SystemExit(f"{KV_SOURCE}: {len(data)} bytes, expected {KV_SLICE}")
    return data


def blocks_before_flush(prefix: str) -> dict[str, tuple[str, bytes]]:
    """key -> (how its bytes were made, the bytes)."""
    return {
        f"{prefix}.small": (f"shake256({prefix}.small) 100 B", seeded(f"{prefix}.small", 100)),
        f"{prefix}.frames3": (
            f"shake256({prefix}.frames3) 150000 B: three 64 KiB frames",
            seeded(f"{prefix}.frames3", 150_000),
        ),
        f"{prefix}.text": (f"text({prefix}) 131072 B", text(prefix, 128 << 10)),
        f"{prefix}.kv-bf16": (f"sources/{KV_SOURCE.name}: the first 64 KiB of a real bf16 KV cache", kv_slice()),
        f"{prefix}.doomed": (
            f"shake256({prefix}.doomed) 5000 B, deleted after the flush",
            seeded(f"{prefix}.doomed", 5000),
        ),
        "shared": (f"shake256({prefix}.shared) 3000 B: the same key in both tenants", seeded(f"{prefix}.shared", 3000)),
    }


def blocks_after_flush(prefix: str) -> dict[str, tuple[str, bytes]]:
    return {
        f"{prefix}.after": (f"shake256({prefix}.after) 20000 B, after the flush", seeded(f"{prefix}.after", 20_000)),
        f"{prefix}.after-text": (f"text({prefix}.after) 70000 B, after the flush", text(f"{prefix}.after", 70_000)),
    }


# -- the daemon and its API ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Daemon:
    def __init__(self, data_dir: Path, key_file: Path, log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(ROOT),
            "KVSTORE_ADMIN_TOKEN": ADMIN,
            "KVSTORE_MASTER_KEY_FILE": str(key_file),
            **SETTINGS,
        }
        cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(data_dir)]
        cmd += ["--listen", f"127.0.0.1:{self.port}"]
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the daemon exited with {self.proc.returncode}:\n{log.read_text()}")
            try:
                if self.call("GET", "/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise SystemExit(f"the daemon did not get ready:\n{log.read_text()}")

    def call(
        self, method: str, path: str, body: bytes | None = None, token: str = ADMIN, json_body: Any = None
    ) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {token}"}
        if json_body is not None:
            body = json.dumps(json_body).encode()
            headers["Content-Type"] = "application/json"
        elif body is not None:
            headers["Content-Type"] = "application/octet-stream"
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def must(self, want: int, method: str, path: str, **kw: Any) -> bytes:
        status, out = self.call(method, path, **kw)
        if status != want:
            raise SystemExit(f"{method} {path}: {status} {out[:500]!r}, expected {want}")
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(60)
        if rc != 0:
            raise SystemExit(f"the daemon exited with {rc} on SIGTERM:\n{self.log.read_text()}")


# -- the fixture ---------------------------------------------------------------------------


def make(out: Path) -> dict[str, Any]:
    data_dir = out / "data"
    key_file = out / "master.key"
    key_file.write_text(MASTER_KEY + "\n")
    key_file.chmod(0o600)
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(data_dir, key_file, Path(tmp) / "server.log")
        try:
            tenants: dict[str, dict[str, Any]] = {}
            blocks: dict[str, dict[str, tuple[str, bytes]]] = {}
            for name, policy, prefix in ((SEALED, "sealed", "s"), (DIRECT, "direct", "d")):
                made = json.loads(d.must(201, "POST", "/v1/admin/tenants", json_body={"name": name, "policy": policy}))
                tenants[name] = {"policy": policy, "compression": made["compression"], "token": made["token"]}
                blocks[name] = blocks_before_flush(prefix)
                for key, (_, data) in blocks[name].items():
                    d.must(201, "PUT", f"/v1/blocks/{key}", body=data, token=made["token"])
            d.must(200, "POST", "/v1/admin/flush")
            d.must(200, "POST", f"/v1/admin/tenants/{SEALED}/rotate-key")
            deleted: dict[str, list[str]] = {}
            for name, prefix in ((SEALED, "s"), (DIRECT, "d")):
                token = tenants[name]["token"]
                doomed = f"{prefix}.doomed"
                d.must(204, "DELETE", f"/v1/blocks/{doomed}", token=token)
                del blocks[name][doomed]
                deleted[name] = [doomed]
                after = blocks_after_flush(prefix)
                for key, (_, data) in after.items():
                    d.must(201, "PUT", f"/v1/blocks/{key}", body=data, token=token)
                blocks[name].update(after)
            for name, got in blocks.items():  # what the daemon serves is what the manifest says
                for key, (_, data) in got.items():
                    served = d.must(200, "GET", f"/v1/blocks/{key}", token=tenants[name]["token"])
                    if served != data:
                        raise SystemExit(f"{name}/{key}: the daemon served other bytes than it was given")
        finally:
            d.stop()
    for name in LEFT_OUT:
        p = data_dir / name
        if p.exists():
            p.unlink()
    for p in [out, *out.rglob("*")]:  # the modes git checks them out with (the test copies them back to 0600)
        p.chmod(0o755 if p.is_dir() else 0o644)
    return manifest(data_dir, tenants, blocks, deleted)


def manifest(
    data_dir: Path,
    tenants: dict[str, dict[str, Any]],
    blocks: dict[str, dict[str, tuple[str, bytes]]],
    deleted: dict[str, list[str]],
) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import kvstore
    from kvstore.engine.segment import SegmentFile

    segments = []
    for p in sorted((data_dir / "segments").rglob("*.seg")):
        seg = SegmentFile.open(p)
        segments.append({"file": str(p.relative_to(data_dir)), "sealed": seg.sealed, "size": seg.size})
        seg.close()
    files = sorted(str(p.relative_to(data_dir)) for p in data_dir.rglob("*") if p.is_file())
    return {
        "written_by": {"kvstore": kvstore.__version__, "script": "tests/data/upgrade/make_fixture.py"},
        "master_key_file": "master.key",
        "admin_token": "any: it is a setting (KVSTORE_ADMIN_TOKEN), not stored in the data directory",
        "settings": SETTINGS,
        "tenants": {
            name: {
                **t,
                "blocks": {
                    key: {"length": len(data), "sha256": hashlib.sha256(data).hexdigest(), "content": how}
                    for key, (how, data) in sorted(blocks[name].items())
                },
                "deleted": deleted[name],
            }
            for name, t in tenants.items()
        },
        "segments": segments,
        "files": files,
    }


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import kvstore

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=HERE / f"v{kvstore.__version__}", help="default: %(default)s")
    p.add_argument("--force", action="store_true", help="replace the directory if it exists (never a committed one)")
    args = p.parse_args()
    out: Path = args.out
    if out.exists():
        if not args.force:
            raise SystemExit(f"{out} exists: fixtures are kept forever; pass --out for a new one")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    doc = make(out)
    (out / "manifest.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}: {len(doc['files'])} data files, {total} bytes in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())

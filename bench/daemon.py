"""A daemon for a benchmark: ``server.py`` on a fresh data directory under
/var/tmp with a fresh master key and admin token, on a free port of
127.0.0.1, and one tenant; stopped (SIGTERM) and removed afterwards."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.plan_bench import _admin, _port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    base: str
    admin: str
    token: str
    root: Path


@contextmanager
def daemon(
    settings: Mapping[str, str], flags: list[str] | None = None, policy: str = "direct", pass_env: str = "UCX_"
) -> Iterator[Daemon]:
    """``settings`` as KVSTORE_<NAME> variables; ``flags`` for server.py;
    the caller's variables starting with ``pass_env`` are passed on. One
    worker unless ``settings`` or ``flags`` say otherwise (not the default,
    "auto": figures from machines with different CPU counts would differ)."""
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir="/var/tmp"))
    admin = secrets.token_hex(16)
    key_file = root / "master.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    port = _port()
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "KVSTORE_ADMIN_TOKEN": admin}
    env |= {"KVSTORE_MASTER_KEY_FILE": str(key_file), "KVSTORE_WORKERS": "1"}
    env |= {k: v for k, v in os.environ.items() if pass_env and k.startswith(pass_env)}
    env |= {"KVSTORE_" + k.upper(): v for k, v in settings.items()}
    cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(root / "data"), "--compact-interval-s", "0"]
    cmd += ["--listen", f"127.0.0.1:{port}", *(flags or [])]
    with (root / "kvstore.log").open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                token = _admin(base, admin, "/v1/admin/tenants", {"name": "bench", "policy": policy})["token"]
                break
            except OSError as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the daemon did not start: {(root / 'kvstore.log').read_text()[-2000:]}") from e
                time.sleep(0.1)
        yield Daemon(proc, base, admin, token, root)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)

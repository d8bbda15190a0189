"""A daemon for a benchmark: ``kvstore serve`` (as ``python -m kvstore serve``,
with this interpreter) on a fresh data directory under /var/tmp with a fresh
master key and admin token, on a free port of 127.0.0.1, and one tenant;
stopped (SIGTERM) and removed afterwards.

The daemon is the installed ``kvstore`` package, found the way this process
finds it: nothing here depends on a checkout's layout."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .harness import free_port


def serve_command(data_dir: Path, *flags: str) -> list[str]:
    """The command line of a daemon on ``data_dir``: the ``kvstore serve`` of the
    ``kvstore`` package this interpreter imports (the wheel's, or a checkout's
    editable install), with ``flags`` (the same as ``kvstore serve --help``'s)."""
    return [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(data_dir), *flags]


def base_env() -> dict[str, str]:
    """What a daemon's environment starts from: PATH, and PYTHONPATH when this
    process has one, so that ``python -m kvstore`` finds the package this process
    would (the benchmark sets the rest: KVSTORE_* settings, keys, tokens)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def _admin(base: str, token: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        doc: dict[str, Any] = json.loads(r.read())
        return doc


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    base: str
    admin: str
    token: str
    root: Path


@contextmanager
def daemon(
    settings: Mapping[str, str],
    flags: list[str] | None = None,
    policy: str = "direct",
    pass_env: str = "UCX_",
    tenant: Mapping[str, Any] | None = None,
) -> Iterator[Daemon]:
    """``settings`` as KVSTORE_<NAME> variables; ``flags`` for ``kvstore serve``;
    the caller's variables starting with ``pass_env`` are passed on. One
    worker unless ``settings`` or ``flags`` say otherwise (not the default,
    "auto": figures from machines with different CPU counts would differ).
    The tenant "bench" is created with ``policy`` and the fields of
    ``tenant`` (e.g. ``admit_after``)."""
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir="/var/tmp"))
    admin = secrets.token_hex(16)
    key_file = root / "master.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    port = free_port()
    env = base_env() | {"KVSTORE_ADMIN_TOKEN": admin}
    env |= {"KVSTORE_MASTER_KEY_FILE": str(key_file), "KVSTORE_WORKERS": "1"}
    env |= {k: v for k, v in os.environ.items() if pass_env and k.startswith(pass_env)}
    env |= {"KVSTORE_" + k.upper(): v for k, v in settings.items()}
    cmd = serve_command(root / "data", "--compact-interval-s", "0", "--listen", f"127.0.0.1:{port}", *(flags or []))
    with (root / "kvstore.log").open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                body = {"name": "bench", "policy": policy, **(tenant or {})}
                token = _admin(base, admin, "/v1/admin/tenants", body)["token"]
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

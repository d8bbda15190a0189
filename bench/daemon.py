"""The one way a benchmark runs the kvstore daemon: ``kvstore serve`` (as
``python -m kvstore serve``, with this interpreter) as a process group of its
own (bench/harness.py's :class:`Processes`), on a data directory with a fresh
master key and admin token, on a free port of 127.0.0.1, ready once it answers
``GET /readyz`` with 200; stopped with SIGTERM (its group SIGKILLed after).

:class:`Kvstore` is the daemon on a directory the caller owns, restartable (a
worker count each time); :func:`daemon` is the common case on top of it: one
daemon on a fresh directory under /var/tmp with one tenant, removed afterwards.
Its CPU seconds: :func:`kvstore_bench.harness.tree_cpu_seconds` of its pid.

The daemon is the installed ``kvstore`` package, found the way this process
finds it: nothing here depends on a checkout's layout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness import Client, Processes, Reply, free_port

WORKERS_REFUSED = "only 1 worker process is supported"


class Unavailable(Exception):
    """A peer or a worker count that cannot be measured here, with the reason."""


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


def wait_http(proc: subprocess.Popen[bytes], port: int, path: str, timeout: float, log: Path | None, what: str) -> None:
    """Wait until ``GET path`` answers 200; raise if the process exits first
    (:class:`Unavailable` when it refused its worker count)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text(errors="replace") if log is not None and log.exists() else ""
            if WORKERS_REFUSED in text:
                raise Unavailable(text.strip().splitlines()[-1])
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was ready:\n{text[-3000:]}")
        c = Client(port)
        try:
            if c.request("GET", path).status == 200:
                return
        except OSError:
            pass
        finally:
            c.close()
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer GET {path} with 200 within {timeout:g} s")


@dataclass
class Kvstore:
    """``kvstore serve`` as a process on one data directory (``root``/data; its
    log ``root``/kvstore.log), restarted per worker count; tenants and their
    tokens persist across restarts (they are in the store).

    Its environment: the caller's variables that start with one of ``pass_env``
    (KVSTORE_SENDFILE=false, say), then PATH/PYTHONPATH, the admin token, the
    master key (``key_file``, else a new one in ``root``), then ``settings`` as
    KVSTORE_<NAME> variables; ``env`` may be changed before :meth:`start`.
    ``durability``: passed as ``--durability`` unless None (the daemon's own)."""

    procs: Processes
    root: Path
    durability: str | None = None
    admin_token: str = field(default_factory=lambda: os.urandom(24).hex())
    tokens: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    settings: Mapping[str, str] = field(default_factory=dict)
    pass_env: tuple[str, ...] = ("KVSTORE_",)
    key_file: Path | None = None
    env: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.key_file is None:
            self.key_file = self.root / "master.key"
            fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
        passed = {k: v for k, v in os.environ.items() if any(k.startswith(p) for p in self.pass_env if p)}
        self.env = {
            **passed,
            **base_env(),
            "KVSTORE_ADMIN_TOKEN": self.admin_token,
            "KVSTORE_MASTER_KEY_FILE": str(self.key_file),
            **{"KVSTORE_" + k.upper(): v for k, v in self.settings.items()},
        }

    @property
    def log(self) -> Path:
        return self.root / "kvstore.log"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, workers: int | None, flags: Sequence[str] = (), port: int = 0, timeout: float = 120) -> None:
        """Start it on ``port`` (0: a free one) with ``--workers workers`` (None:
        no flag; the environment's or the daemon's default) and ``flags``, and
        wait until it is ready (:class:`Unavailable` if it refused ``workers``)."""
        self.port = port or free_port()
        cmd = serve_command(self.root / "data", "--listen", f"127.0.0.1:{self.port}")
        if workers is not None:
            cmd += ["--workers", str(workers)]
        if self.durability is not None:
            cmd += ["--durability", self.durability]
        cmd += flags
        with self.log.open("a") as f:
            f.write(f"\n=== {' '.join(cmd)}\n")
        self.proc = self.procs.spawn(cmd, self.log, self.env)
        try:
            wait_http(self.proc, self.port, "/readyz", timeout, self.log, "kvstore")
        except BaseException:
            self.stop()
            raise

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        """Stop it: ``sig`` (SIGTERM; SIGKILL to kill it) to the daemon, then its
        whole process group SIGKILLed (see :meth:`Processes.stop`)."""
        if self.proc is not None:
            self.procs.stop(self.proc, sig, timeout=timeout)
            self.proc = None

    @property
    def pgid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def admin(self, method: str, path: str, doc: dict[str, Any] | None = None) -> Reply:
        c = Client(self.port, self.admin_token)
        try:
            body = None if doc is None else json.dumps(doc).encode()
            return c.request(method, path, body, {"Content-Type": "application/json"} if body else None)
        finally:
            c.close()

    def create_tenant(self, name: str, policy: str, fields: Mapping[str, Any] | None = None) -> str:
        """A new tenant (``fields``: more of its settings, e.g. ``admit_after``); its token."""
        r = self.admin("POST", "/v1/admin/tenants", {"name": name, "policy": policy, **(fields or {})})
        if r.status != 201:
            raise RuntimeError(f"creating tenant {name!r}: HTTP {r.status}: {r.body[:500]!r}")
        token: str = r.json()["token"]
        self.tokens[name] = token
        return token

    def delete_tenant(self, name: str) -> None:
        r = self.admin("DELETE", f"/v1/admin/tenants/{name}")
        if r.status != 204:
            raise RuntimeError(f"deleting tenant {name!r}: HTTP {r.status}: {r.body[:500]!r}")
        self.tokens.pop(name, None)


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
    """What :func:`daemon` yields: the daemon's process, its URL, its admin
    token, the tenant "bench"'s token, and its directory."""

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
    """A :class:`Kvstore` on a fresh directory under /var/tmp, removed afterwards.
    ``settings`` as KVSTORE_<NAME> variables; ``flags`` for ``kvstore serve``
    (after ``--compact-interval-s 0``); the caller's variables starting with
    ``pass_env`` are passed on. One worker unless ``settings`` or ``flags`` say
    otherwise (not the default, "auto": figures from machines with different
    CPU counts would differ). The tenant "bench" is created with ``policy`` and
    the fields of ``tenant`` (e.g. ``admit_after``)."""
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir="/var/tmp"))
    procs = Processes()
    try:
        kv = Kvstore(procs, root, settings={"workers": "1", **settings}, pass_env=(pass_env,))
        try:
            kv.start(None, ["--compact-interval-s", "0", *(flags or [])], timeout=60)
        except (RuntimeError, Unavailable) as e:
            raise SystemExit(f"the daemon did not start: {e}") from e
        try:
            assert kv.proc is not None
            token = kv.create_tenant("bench", policy, tenant)
            yield Daemon(kv.proc, kv.base, kv.admin_token, token, root)
        finally:
            kv.stop(timeout=30)
    finally:
        procs.stop_all()
        shutil.rmtree(root, ignore_errors=True)

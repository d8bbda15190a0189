"""A real kvstore HTTP server on 127.0.0.1: in-process (fast) or as a process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from aiohttp.web_runner import BaseRunner

from kvstore.daemon.app import make_app
from kvstore.engine.crypto import MasterKey
from kvstore.server_config import ServerConfig, load
from kvstore.transport.http.connection import KVAppRunner

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "admin-token-for-tests-0123456789"


@dataclass
class Api:
    """A running server and a client session; ``admin`` and tenant helpers."""

    base: str
    session: aiohttp.ClientSession
    config: ServerConfig
    tokens: dict[str, str] = field(default_factory=dict)
    server: TestServer | None = None  # the in-process server (the ``api`` fixture's)

    def url(self, path: str) -> str:
        return self.base + path

    @staticmethod
    def auth(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    async def tenant(self, name: str, policy: str = "sealed", **fields: Any) -> str:
        """Create tenant ``name`` (``fields``: more of the creation body); its token."""
        body = {"name": name, "policy": policy, **fields}
        async with self.session.post(self.url("/v1/admin/tenants"), json=body, headers=self.auth(ADMIN)) as r:
            assert r.status == 201, await r.text()
            token: str = (await r.json())["token"]
        self.tokens[name] = token
        return token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def server_config(data_dir: Path, **flags: Any) -> ServerConfig:
    base = {
        "data_dir": str(data_dir),
        "segment_size": "1MiB",
        "frame_size": "64KiB",
        "max_block_size": "4MiB",
        "max_lookup_keys": "256",
        "max_batch_keys": "64",
    }
    return load(None, env={"KVSTORE_ADMIN_TOKEN": ADMIN}, flags={**base, **flags})


class KVTestServer(TestServer):
    """aiohttp's TestServer with the daemon's runner (kvstore's answers to
    parser errors and disconnects, the same parser limits)."""

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        return KVAppRunner(self.app, **kwargs)


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, **flags: str) -> AsyncIterator[Api]:
    """An in-process server with ``flags`` (settings, as server_config takes them)."""
    cfg = server_config(tmp_path / "data", **flags)
    server = KVTestServer(make_app(cfg, MasterKey(os.urandom(32))), host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            yield Api(f"http://127.0.0.1:{server.port}", session, cfg, server=server)
    finally:
        await server.close()


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with serving(tmp_path) as api:
        yield api


@dataclass
class Daemon:
    """``server.py`` running as its own process, per the start-up contract."""

    data_dir: Path
    port: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    extra: list[str] = field(default_factory=list)
    # Where server.log goes (default: beside the data directory). A test that
    # fills the data directory's filesystem puts it elsewhere: a log on a full
    # disk would fail the daemon's last flush at exit (status 120).
    log_dir: Path | None = None
    # Its own process group (a daemon of several workers as one node): SIGKILL,
    # SIGSTOP and SIGCONT (signal_all) then reach every worker, as a machine's
    # crash or a frozen container would, not the supervisor alone.
    own_group: bool = False

    @property
    def base(self) -> str:
        scheme = "https" if "--tls-cert" in self.extra else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> None:
        cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(self.data_dir)]
        cmd += ["--listen", f"127.0.0.1:{self.port}", *self.extra]
        with self.log.open("ab") as log:  # a file, not a pipe: a full pipe would stall the server
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=self.own_group
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("server did not start listening")

    def signal_all(self, sig: int) -> None:
        """``sig`` to the daemon: to its whole group when it has one of its own."""
        assert self.proc is not None
        if self.own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
        elif self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """SIGTERM: to the supervisor, which stops its workers in order;
        SIGKILL: to every process of the daemon (its group, if it has one)."""
        assert self.proc is not None
        if sig == signal.SIGKILL:
            self.signal_all(sig)
        elif self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self.output = self.log.read_text()
        self.proc = None
        return rc

    output: str = ""

    @property
    def log(self) -> Path:
        return (self.log_dir or self.data_dir.parent) / "server.log"


def daemon_env(workdir: Path, **settings: str) -> dict[str, str]:
    """The environment of a test daemon: a fresh master key file (mode 0600) in
    ``workdir``, the admin token, one worker, and ``settings`` as
    KVSTORE_<NAME> variables.

    One worker unless ``settings`` or a ``--workers`` flag (which beats the
    environment) asks for more: the daemon's default, "auto", would start one
    per CPU, and the tests would differ from machine to machine."""
    key = workdir / "master.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "KVSTORE_ADMIN_TOKEN": ADMIN,
        "KVSTORE_MASTER_KEY_FILE": str(key),
        "KVSTORE_WORKERS": "1",
        "PYTHONPATH": str(ROOT),
    }
    return env | {"KVSTORE_" + name.upper(): value for name, value in settings.items()}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    env = daemon_env(tmp_path, segment_size="1MiB", frame_size="64KiB")
    d = Daemon(tmp_path / "data", free_port(), env)
    yield d
    if d.proc is not None:
        d.stop(signal.SIGKILL)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for a unix socket (pytest's paths can pass the
    108 bytes a socket path may have) that another user can reach
    (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="kvs-sock-"))
    d.chmod(0o755)
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()

"""Real kvstore daemons (``server.py`` as a process) for the client tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "admin-token-for-client-tests-0123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Daemon:
    """``server.py`` on 127.0.0.1:port; restartable on the same port and data."""

    def __init__(self, workdir: Path, **settings: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.port = free_port()
        key = workdir / "master.key"
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(ROOT),
            "KVSTORE_ADMIN_TOKEN": ADMIN,
            "KVSTORE_MASTER_KEY_FILE": str(key),
            "KVSTORE_SEGMENT_SIZE": "4MiB",
            "KVSTORE_FRAME_SIZE": "64KiB",
            "KVSTORE_DURABILITY": "interval",
            "KVSTORE_WORKERS": "1",  # not the default "auto" (one per CPU): the same daemon on every machine
            **{f"KVSTORE_{k.upper()}": v for k, v in settings.items()},
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.token = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20) -> Daemon:
        cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(self.workdir / "data")]
        cmd += ["--listen", f"127.0.0.1:{self.port}"]
        with (self.workdir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {(self.workdir / 'server.log').read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("server did not become ready")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
            self.proc.wait(20)
            self.proc = None

    def admin(self, method: str, path: str, body: object | None = None) -> dict[str, object]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {ADMIN}")
        with urllib.request.urlopen(req, timeout=10) as r:
            doc: dict[str, object] = json.loads(r.read() or b"{}")
            return doc

    def tenant(self, name: str = "acme") -> str:
        self.token = str(self.admin("POST", "/v1/admin/tenants", {"name": name})["token"])
        return self.token

    def blocks(self) -> int:
        req = urllib.request.Request(self.url + "/v1/stats")
        req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(json.loads(r.read())["blocks"])


DaemonFactory = Callable[..., Daemon]


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[DaemonFactory]:
    started: list[Daemon] = []

    def make(**settings: str) -> Daemon:
        d = Daemon(tmp_path / f"d{len(started)}", **settings)
        started.append(d)
        d.start()
        d.tenant()
        return d

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(make_daemon: DaemonFactory) -> Daemon:
    return make_daemon(max_block_size="1MiB")

"""Wheels built and installed as users install them, for the release tests:
a clean virtualenv, PyPI alone (no configuration of this machine's), and
every command run from outside the repository with no PYTHONPATH, so that
nothing of the checkout can be imported; and the daemon started from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.http.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
PYPI = "https://pypi.org/simple"
ADMIN = "wheel-test-admin-token-0123456789abcdef"


@dataclass
class Venv:
    root: Path
    dist: Path
    home: Path  # a working directory outside the repository

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": f"{self.root / 'bin'}:/usr/bin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8", **extra}

    def run(self, *cmd: str, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cmd, cwd=self.home, env=self.env(**extra), capture_output=True, text=True, timeout=timeout
        )


def pip_env() -> dict[str, str]:
    """pip with no configuration of this machine's (no local wheel folders or
    extra indexes): PyPI alone, as a user's machine has it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if os.environ.get("PIP_CERT"):
        env["PIP_CERT"] = os.environ["PIP_CERT"]
    env.pop("PYTHONPATH", None)
    return env


def pip_ok(python: str, command: str, *args: str, cwd: Path) -> None:
    out = subprocess.run(
        [python, "-m", "pip", command, "--quiet", "--index-url", PYPI, *args],
        cwd=cwd,
        env=pip_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]


def build_wheels(tree: Path, dist: Path) -> list[Path]:
    """The two wheels of the source tree ``tree`` (the repository or an
    export of one of its commits), built into ``dist``."""
    dist.mkdir(parents=True, exist_ok=True)
    pip_ok(sys.executable, "wheel", "--no-deps", "-w", str(dist), ".", "./clients", cwd=tree)
    wheels = sorted(dist.glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["kvstore_client", "kvstore_server"], wheels
    return wheels


def new_venv(base: Path, dist: Path) -> Venv:
    root, home = base / "venv", base / "home"
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    return Venv(root, dist, home)


@contextmanager
def daemon(venv: Venv, data: Path, key: Path) -> Iterator[str]:
    """``kvstore serve`` from ``venv`` on ``data`` until the block ends
    (then SIGTERM, which must end it with exit 0); yields its URL."""
    if not key.exists():
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
    port = free_port()
    log = data.parent / f"{data.name}-{time.monotonic_ns()}.log"
    with log.open("wb") as out:  # a file, not a pipe: a full pipe would stall the daemon
        proc = subprocess.Popen(
            [venv.bin("kvstore"), "serve", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"],
            cwd=venv.home,
            env=venv.env(KVSTORE_ADMIN_TOKEN=ADMIN, KVSTORE_MASTER_KEY_FILE=str(key), KVSTORE_WORKERS="1"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    stopped = False
    try:
        deadline = time.monotonic() + 60
        while f"kvstore serving on http://127.0.0.1:{port}" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        stopped = True
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if not stopped:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

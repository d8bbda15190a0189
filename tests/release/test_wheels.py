"""The wheels as users install them: built here, installed into a clean
virtualenv from PyPI alone, and run from outside the checkout.

Used to be: the daemon's wheel required ``kvstore-client==0.1.0``, on no
index; it installed no command that starts the daemon (``server.py`` was not
in it), a top-level package ``bench`` under a distribution named ``kvstore``
(both names other PyPI projects hold), and ``kvstore-bench codec`` failed for
want of its KV samples (they lived in tests/).

One module-scoped virtualenv (the install takes a minute from pip's cache);
every test runs its commands with the working directory outside the
repository and no PYTHONPATH, so nothing of the checkout can be imported.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore import __version__
from tests.http.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
PYPI = "https://pypi.org/simple"
pytestmark = pytest.mark.slow


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


def _pip_env() -> dict[str, str]:
    """pip with no configuration of this machine's (no local wheel folders or
    extra indexes): PyPI alone, as a user's machine has it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if os.environ.get("PIP_CERT"):
        env["PIP_CERT"] = os.environ["PIP_CERT"]
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    base = tmp_path_factory.mktemp("wheels")
    dist, root, home = base / "dist", base / "venv", base / "home"
    home.mkdir()

    def pip_ok(python: str, command: str, *args: str, cwd: Path) -> None:
        out = subprocess.run(
            [python, "-m", "pip", command, "--quiet", "--index-url", PYPI, *args],
            cwd=cwd,
            env=_pip_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, out.stderr[-3000:]

    pip_ok(sys.executable, "wheel", "--no-deps", "-w", str(dist), ".", "./clients", cwd=ROOT)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    pip_ok(str(root / "bin" / "python"), "install", *sorted(str(p) for p in dist.glob("*.whl")), cwd=home)
    return Venv(root, dist, home)


def test_two_wheels_with_names_of_their_own(venv: Venv) -> None:
    names = sorted(p.name.split("-")[0] for p in venv.dist.glob("*.whl"))
    assert names == ["kvstore_client", "kvstore_server"]
    # Every top-level name the two distributions install is one of these.
    out = venv.run(
        venv.bin("python"),
        "-c",
        "import json, importlib.metadata as m;"
        "names = ('kvstore-server', 'kvstore-client');"
        "print(json.dumps({d: sorted({f.parts[0] for f in m.files(d)}) for d in names}))",
    )
    assert out.returncode == 0, out.stderr
    tops = json.loads(out.stdout)
    code = {
        d: {t for t in ts if not t.endswith(".dist-info") and t not in ("..", "__pycache__")} for d, ts in tops.items()
    }
    assert code["kvstore-server"] == {"kvstore", "kvstore_bench"}, tops
    assert code["kvstore-client"] == {"kvstore_client"}, tops
    site = venv.run(
        venv.bin("python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    ).stdout.strip()
    assert not (Path(site) / "bench").exists() and not (Path(site) / "tests").exists()


def test_version(venv: Venv) -> None:
    out = venv.run(venv.bin("kvstore"), "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvstore {__version__}"
    meta = venv.run(venv.bin("python"), "-c", "import importlib.metadata as m; print(m.version('kvstore-server'))")
    assert meta.stdout.strip() == __version__


@pytest.fixture
def served(venv: Venv) -> Iterator[tuple[str, str, subprocess.Popen[bytes], Path]]:
    """``kvstore serve`` from the venv, on a fresh data directory."""
    data = venv.home / f"data-{time.monotonic_ns()}"
    key = venv.home / "master.key"
    if not key.exists():
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
    admin = "wheel-test-admin-token-0123456789abcdef"
    port = free_port()
    log = venv.home / f"{data.name}.log"
    with log.open("wb") as out:  # a file, not a pipe: a full pipe would stall the daemon
        proc = subprocess.Popen(
            [venv.bin("kvstore"), "serve", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"],
            cwd=venv.home,
            env=venv.env(KVSTORE_ADMIN_TOKEN=admin, KVSTORE_MASTER_KEY_FILE=str(key), KVSTORE_WORKERS="1"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while f"kvstore serving on http://127.0.0.1:{port}" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", admin, proc, data
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_serve_stores_and_reads_a_block_with_the_client_wheel(
    venv: Venv, served: tuple[str, str, subprocess.Popen[bytes], Path]
) -> None:
    base, admin, proc, data = served
    req = urllib.request.Request(
        base + "/v1/admin/tenants",
        data=json.dumps({"name": "wheel", "policy": "sealed"}).encode(),
        headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        token = json.loads(r.read())["token"]
    script = (
        "import os, sys, kvstore_client as k\n"
        "c = k.Client(sys.argv[1], sys.argv[2])\n"
        "block = os.urandom(1 << 20)\n"
        "assert c.put('wheel-block', block)\n"
        "assert c.get('wheel-block') == block\n"
        "print('ok', k.__version__)\n"
    )
    out = venv.run(venv.bin("python"), "-c", script, base, token, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok "), out.stdout + out.stderr
    status = urllib.request.Request(base + "/v1/admin/status", headers={"Authorization": f"Bearer {admin}"})
    with urllib.request.urlopen(status, timeout=30) as r:
        assert json.loads(r.read())["version"] == __version__
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    fsck = venv.run(
        venv.bin("kvstore"), "fsck", "--data-dir", str(data), KVSTORE_MASTER_KEY_FILE=str(venv.home / "master.key")
    )
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_serve_help_from_the_wheel(venv: Venv) -> None:
    out = venv.run(venv.bin("kvstore"), "serve", "--help")
    assert out.returncode == 0
    assert re.search(r"--segment-size VALUE\s+\S", out.stdout) and "(default: " in out.stdout


def test_bench_codec_runs_from_the_wheel(venv: Venv) -> None:
    out = venv.run(venv.bin("kvstore-bench"), "codec", "--help")
    assert out.returncode == 0, out.stderr
    run = venv.run(venv.bin("kvstore-bench"), "codec", "--repeats", "1", timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "gemma3-270m" in run.stdout  # it found its KV samples in the package

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
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from kvstore import __version__
from tests.release.installs import ADMIN, ROOT, Venv, build_wheels, daemon, new_venv, pip_ok

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    base = tmp_path_factory.mktemp("wheels")
    wheels = build_wheels(ROOT, base / "dist")
    venv = new_venv(base, base / "dist")
    pip_ok(venv.bin("python"), "install", *map(str, wheels), cwd=venv.home)
    return venv


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


def test_serve_stores_and_reads_a_block_with_the_client_wheel(venv: Venv) -> None:
    data = venv.home / f"data-{time.monotonic_ns()}"
    with daemon(venv, data, venv.home / "master.key") as base:  # stopped with SIGTERM: exit 0
        req = urllib.request.Request(
            base + "/v1/admin/tenants",
            data=json.dumps({"name": "wheel", "policy": "sealed"}).encode(),
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
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
        status = urllib.request.Request(base + "/v1/admin/status", headers={"Authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(status, timeout=30) as r:
            assert json.loads(r.read())["version"] == __version__
    fsck = venv.run(
        venv.bin("kvstore"), "fsck", "--data-dir", str(data), KVSTORE_MASTER_KEY_FILE=str(venv.home / "master.key")
    )
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_serve_help_from_the_wheel(venv: Venv) -> None:
    out = venv.run(venv.bin("kvstore"), "serve", "--help")
    assert out.returncode == 0
    assert re.search(r"--segment-size VALUE\s+\S", out.stdout) and "(default: " in out.stdout


def test_completion_and_man_page_install_where_shells_and_man_look(venv: Venv) -> None:
    """The wheel's data files land under the environment's share/: bash's
    and zsh's completion and the man page, as committed (deploy/share/), and
    man finds the page from the command's directory on PATH."""
    for rel in ("bash-completion/completions/kvstore", "zsh/site-functions/_kvstore", "man/man1/kvstore.1"):
        installed = venv.root / "share" / rel
        assert installed.read_text() == (ROOT / "deploy" / "share" / rel).read_text(), rel
    if shutil.which("man") is not None:
        out = venv.run("man", "-w", "kvstore")
        assert out.returncode == 0 and out.stdout.strip() == str(venv.root / "share/man/man1/kvstore.1"), out


def test_bench_codec_runs_from_the_wheel(venv: Venv) -> None:
    out = venv.run(venv.bin("kvstore-bench"), "codec", "--help")
    assert out.returncode == 0, out.stderr
    run = venv.run(venv.bin("kvstore-bench"), "codec", "--repeats", "1", timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "gemma3-270m" in run.stdout  # it found its KV samples in the package

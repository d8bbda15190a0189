"""The documented upgrade, as an operator runs it: the previous release's
wheels (built from its commit) installed and serving, data written, the
node stopped, this tree's wheels installed with exactly the command of
docs/operations.md's step 5, and the new daemon reading every block back.

Used to be: every build since the wheels exist called itself 0.1.0, so the
documented ``pip install --upgrade`` printed "Requirement already
satisfied", exited 0, and the old code kept running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from kvstore import __commit__, __version__
from tests.release.installs import ADMIN, PYPI, ROOT, Venv, build_wheels, daemon, new_venv, pip_env, pip_ok

pytestmark = pytest.mark.slow

DOC = ROOT / "docs" / "operations.md"
DOC_VENV = "/opt/kvstore/.venv"


def previous_release() -> tuple[str, str]:
    """The newest released version in CHANGELOG.md and its commit (the
    section says "Tagged `vX.Y.Z`, commit `HASH`"); the tag, where this
    clone has it, must name the same commit."""
    text = (ROOT / "CHANGELOG.md").read_text()
    found = re.search(r"^## (\d+\.\d+\.\d+) — \d{4}-\d{2}-\d{2}\n\nTagged `v\1`, commit `([0-9a-f]{7,40})`", text, re.M)
    assert found, "CHANGELOG.md names no released version with its tag and commit"
    version, commit = found.groups()
    full = _git("rev-parse", "--verify", f"{commit}^{{commit}}")
    tagged = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"v{version}^{{commit}}"], cwd=ROOT, capture_output=True, text=True
    )
    if tagged.returncode == 0:
        assert tagged.stdout.strip() == full, f"tag v{version} is not the commit CHANGELOG.md names"
    return version, full


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"git {' '.join(args)}: {out.stderr.strip()} (the test needs the repository's history)"
    return out.stdout.strip()


def export(commit: str, into: Path) -> Path:
    """The tree of ``commit``, as files (``git archive``)."""
    archive = into.with_suffix(".tar")
    subprocess.run(["git", "archive", "-o", str(archive), commit], cwd=ROOT, check=True, timeout=120)
    into.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def upgrade_command() -> str:
    """Step 5's command, as docs/operations.md gives it."""
    lines = [x.strip() for x in DOC.read_text().splitlines() if x.strip().startswith(f"{DOC_VENV}/bin/pip install")]
    assert len(lines) == 1, f"docs/operations.md should give the upgrade command once: {lines}"
    return lines[0]


def call(url: str, method: str = "GET", body: bytes | None = None, token: str = ADMIN, **headers: str) -> Any:
    req = urllib.request.Request(url, data=body, method=method, headers={"Authorization": f"Bearer {token}", **headers})
    with urllib.request.urlopen(req, timeout=60) as r:
        data = r.read()
        return json.loads(data) if r.headers.get("Content-Type", "").startswith("application/json") else data


def version_of(venv: Venv) -> str:
    out = venv.run(venv.bin("kvstore"), "--version")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().removeprefix("kvstore ")


def test_upgrade_from_the_previous_release_as_documented(tmp_path: Path) -> None:
    old_version, old_commit = previous_release()
    assert Version(__version__) > Version(old_version), f"this build ({__version__}) is not newer than {old_version}"
    old_wheels = build_wheels(export(old_commit, tmp_path / "old-tree"), tmp_path / "old-dist")
    new_dist = tmp_path / "new-dist"
    build_wheels(ROOT, new_dist)

    venv = new_venv(tmp_path, tmp_path / "old-dist")
    pip_ok(venv.bin("python"), "install", *map(str, old_wheels), cwd=venv.home)
    assert version_of(venv) == old_version

    data, key = venv.home / "data", venv.home / "master.key"
    blocks: dict[tuple[str, str], bytes] = {}
    with daemon(venv, data, key) as url:
        assert call(url + "/v1/admin/status")["version"] == old_version
        for policy in ("sealed", "direct"):
            token = call(url + "/v1/admin/tenants", "POST", json.dumps({"name": policy, "policy": policy}).encode())[
                "token"
            ]
            for i in range(24):
                block = os.urandom(4096 * (1 + i % 5) + i)  # across page edges
                call(url + f"/v1/blocks/k{i}", "PUT", block, token)
                blocks[(token, f"k{i}")] = block
            if policy == "sealed":
                call(url + "/v1/admin/flush", "POST")  # some in sealed segments, the rest left open

    # Step 5, exactly as written, from the folder of the new wheels.
    command = upgrade_command().replace(DOC_VENV, str(venv.root)) + f" --index-url {PYPI}"
    out = subprocess.run(
        command,
        shell=True,
        cwd=new_dist,
        env={**venv.env(), **pip_env()},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Successfully installed" in out.stdout and "kvstore-server" in out.stdout, out.stdout[-2000:]
    assert version_of(venv) == __version__

    fsck = venv.run(venv.bin("kvstore"), "fsck", "--data-dir", str(data), KVSTORE_MASTER_KEY_FILE=str(key))
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    with daemon(venv, data, key) as url:
        status = call(url + "/v1/admin/status")
        assert (status["version"], status["commit"]) == (__version__, __commit__)
        for (token, name), block in blocks.items():
            assert call(url + f"/v1/blocks/{name}", token=token) == block, name
        token = next(iter(blocks))[0]
        call(url + "/v1/blocks/after-upgrade", "PUT", b"new" * 4096, token)
        assert call(url + "/v1/blocks/after-upgrade", token=token) == b"new" * 4096
        try:
            call(url + "/v1/blocks/k0", token="not-a-token-of-any-tenant-0123456789")
            raise AssertionError("an unknown token read a block")
        except urllib.error.HTTPError as e:
            assert e.code == 401

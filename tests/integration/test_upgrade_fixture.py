"""Every data directory an earlier release wrote is opened and served, byte-exact.

Keep this test forever. Each ``tests/data/upgrade/vX.Y.Z/`` is a data
directory written by release X.Y.Z with its own formats (see its README.md
and docs/operations.md, "Formats"): two tenants (sealed and direct), blocks
in a sealed segment and in an open one, a deleted block, a rotated data key.
For each directory, on a copy (the committed one is never opened in place:
recovery may write), this test checks that the revision under test:

- passes ``kvstore fsck`` on the copy as it was committed (exit 0);
- starts on it (migrating whatever it migrates), with no torn tail cut and
  no record reported corrupt;
- serves every block of the manifest byte-exact (GET, a range, HEAD's
  length), answers 404 for the deleted ones, and serves each tenant's token
  its own blocks only;
- takes a new PUT and serves it;
- after a restart on the same copy, serves all of it again.

When a persisted format changes (its version constant is bumped; see
docs/operations.md), run ``tests/data/upgrade/make_fixture.py`` under the
new revision: it writes ``tests/data/upgrade/vNEW/`` (``kvstore.__version__``),
which this test then opens too, as a new case. Never edit or delete an
existing directory: each one is what an operator's disk holds after that
release.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.http.conftest import ADMIN, Daemon, free_port

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = sorted(p for p in (ROOT / "tests" / "data" / "upgrade").glob("v*") if (p / "manifest.json").is_file())


def http(base: str, method: str, path: str, token: str, body: bytes | None = None, **headers: str) -> Any:
    """(status, headers, body) of one request."""
    h = {"Authorization": f"Bearer {token}", **headers}
    if body is not None:
        h["Content-Type"] = "application/octet-stream"
    req = urllib.request.Request(base + path, data=body, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


@pytest.fixture(params=FIXTURES, ids=[p.name for p in FIXTURES])
def copy(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A copy of one fixture directory (its files as git checks them out),
    and its manifest."""
    src: Path = request.param
    dest = tmp_path / src.name
    shutil.copytree(src, dest)
    (dest / "master.key").chmod(0o600)  # git keeps 0644; the daemon refuses a key others can read
    return dest, json.loads((dest / "manifest.json").read_text())


def env_of(fixture: Path, manifest: dict[str, Any]) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "KVSTORE_ADMIN_TOKEN": ADMIN,
        "KVSTORE_MASTER_KEY_FILE": str(fixture / manifest["master_key_file"]),
        **manifest["settings"],
    }


def fsck(data_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvstore.fsck", "--data-dir", str(data_dir)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


def started(d: Daemon) -> dict[str, Any]:
    """Start the daemon; the recovery report once it is ready."""
    d.start(timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, _, body = http(d.base, "GET", "/readyz", ADMIN)
        if status == 200:
            report: dict[str, Any] = json.loads(body)["recovery"]
            return report
        time.sleep(0.1)
    raise TimeoutError(f"the daemon did not get ready: {d.log.read_text()}")


def check_served(base: str, manifest: dict[str, Any], extra: dict[str, dict[str, bytes]]) -> None:
    """Every block of the manifest (and ``extra``: tenant -> key -> bytes
    written by this test) byte-exact to its own tenant only; deleted ones 404."""
    tenants = manifest["tenants"]
    for name, t in tenants.items():
        token = t["token"]
        for key, want in t["blocks"].items():
            status, headers, body = http(base, "GET", f"/v1/blocks/{key}", token)
            assert status == 200, f"{name}/{key}: GET answered {status} {body[:300]!r}"
            assert len(body) == want["length"], f"{name}/{key}: {len(body)} bytes, expected {want['length']}"
            assert hashlib.sha256(body).hexdigest() == want["sha256"], f"{name}/{key}: other bytes than were stored"
            status, headers, _ = http(base, "HEAD", f"/v1/blocks/{key}", token)
            assert status == 200 and int(headers["Content-Length"]) == want["length"], f"{name}/{key}: HEAD"
            if want["length"] > 100_000:  # a range across frames: only the frames it covers are decoded
                lo, hi = 70_000, want["length"] - 1000
                status, _, part = http(base, "GET", f"/v1/blocks/{key}", token, Range=f"bytes={lo}-{hi - 1}")
                assert status == 206 and part == body[lo:hi], f"{name}/{key}: a range read differs"
        for key in t["deleted"]:
            for method in ("GET", "HEAD"):
                status, _, _ = http(base, method, f"/v1/blocks/{key}", token)
                assert status == 404, f"{name}/{key}: deleted, but {method} answered {status}"
        for key, data in extra.get(name, {}).items():
            status, _, body = http(base, "GET", f"/v1/blocks/{key}", token)
            assert status == 200 and body == data, f"{name}/{key}: a block written after the upgrade"
        for other, o in tenants.items():  # the other tenants' keys are not this token's
            if other == name:
                continue
            for key in o["blocks"]:
                if key in t["blocks"]:
                    continue  # the same key in both tenants: checked above, with this tenant's own bytes
                status, _, _ = http(base, "GET", f"/v1/blocks/{key}", token)
                assert status == 404, f"{other}/{key} answered {status} to {name}'s token"


def test_an_older_data_directory_is_opened_and_served(copy: tuple[Path, dict[str, Any]]) -> None:
    fixture, manifest = copy
    data_dir = fixture / "data"
    env = env_of(fixture, manifest)

    checked = fsck(data_dir, env)
    assert checked.returncode == 0, f"fsck of the fixture as committed: {checked.stdout}{checked.stderr}"

    d = Daemon(data_dir, free_port(), env, log_dir=fixture)
    written: dict[str, dict[str, bytes]] = {}
    try:
        report = started(d)
        assert not report["truncated"] and not report["corrupt"], f"recovery on the fixture: {report}"
        check_served(d.base, manifest, written)
        for name, t in manifest["tenants"].items():
            data = os.urandom(100_000)
            status, _, body = http(d.base, "PUT", "/v1/blocks/new.after-upgrade", t["token"], data)
            assert status == 201, f"{name}: PUT after the upgrade answered {status} {body[:300]!r}"
            written[name] = {"new.after-upgrade": data}
        check_served(d.base, manifest, written)
        assert d.stop() == 0, d.output

        report = started(d)  # the same copy, as this revision left it
        assert not report["truncated"] and not report["corrupt"], f"recovery after a restart: {report}"
        check_served(d.base, manifest, written)
        assert d.stop() == 0, d.output
    finally:
        if d.proc is not None:
            d.stop(signal.SIGKILL)

    checked = fsck(data_dir, env)
    assert checked.returncode == 0, f"fsck after this revision ran on it: {checked.stdout}{checked.stderr}"


def test_there_is_a_fixture_of_this_release_s_formats() -> None:
    """At least the first one is here, with what every later one must hold."""
    assert FIXTURES, "no tests/data/upgrade/v*/manifest.json: run tests/data/upgrade/make_fixture.py"
    for p in FIXTURES:
        m = json.loads((p / "manifest.json").read_text())
        assert {t["policy"] for t in m["tenants"].values()} == {"sealed", "direct"}, p
        assert all(t["deleted"] for t in m["tenants"].values()), p
        sealed = {s["file"].split("/")[1] for s in m["segments"] if s["sealed"]}
        unsealed = {s["file"].split("/")[1] for s in m["segments"] if not s["sealed"]}
        assert sealed == unsealed == set(m["tenants"]), f"{p}: each tenant needs a sealed and an open segment"
        on_disk = sorted(str(f.relative_to(p / "data")) for f in (p / "data").rglob("*") if f.is_file())
        assert on_disk == m["files"], f"{p}: files differ from the manifest's (a LOCK or a leftover?)"
        assert not {"LOCK", "reserve", "index/lock.mdb"} & set(on_disk), p

"""An object tier the node cannot use because of its configuration stops
start-up, on a single node as on a fleet node: one line naming the bucket or
the credentials' source, exit 2. An endpoint that does not answer is not a
configuration error: the node serves its local data, and says so in
``/readyz`` and the admin status until the tier answers.

Used to be: a single node with a wrong bucket or no credentials logged
NoSuchBucket as "object tier unreachable", answered ``/readyz`` 200 and ran
as G3 only, its persistent tenants never reaching S3 (a fleet node in the
same case refused to start); and each stop of such a node logged a false
``ERROR ... 0 sealed segments (0 bytes) are not in the object tier``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.http.conftest import ADMIN, ROOT, Daemon, daemon_env, free_port
from tests.moto_s3 import AWS_ENV, S3Env

pytestmark = pytest.mark.slow


def start_up(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``kvstore serve`` that is expected not to start: its exit and output."""
    cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(tmp_path / "data")]
    cmd += ["--listen", f"127.0.0.1:{free_port()}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def one_line(out: subprocess.CompletedProcess[str], *words: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr
    said = [x for x in out.stderr.splitlines() if x.startswith("kvstore")]
    assert len(said) == 1, out.stderr
    for word in words:
        assert word in said[0], said[0]
    return said[0]


def test_a_missing_bucket_stops_a_single_node(tmp_path: Path, s3: S3Env) -> None:
    bucket = f"no-such-{uuid.uuid4().hex[:8]}"
    env = daemon_env(tmp_path, s3_bucket=bucket, s3_endpoint=s3.url) | AWS_ENV
    line = one_line(start_up(tmp_path, env), f"s3_bucket={bucket!r}", "no such bucket", s3.url)
    assert "does not create its bucket" in line


@pytest.fixture(scope="module")
def moto_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server that checks credentials (INITIAL_NO_AUTH_ACTION_COUNT=0):
    it knows no access key, so every request is refused with 403."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto-auth") / "moto.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def test_access_denied_stops_start_up_naming_the_credentials_source(tmp_path: Path, moto_with_auth: str) -> None:
    env = daemon_env(tmp_path, s3_bucket="some-bucket", s3_endpoint=moto_with_auth) | AWS_ENV
    one_line(
        start_up(tmp_path, env),
        "s3_bucket='some-bucket'",
        "access denied",
        "credentials from the environment (AWS_ACCESS_KEY_ID)",
    )
    assert AWS_ENV["AWS_SECRET_ACCESS_KEY"] not in start_up(tmp_path, env).stderr.replace("testing-", "")


def test_no_credentials_stop_start_up(tmp_path: Path, s3: S3Env) -> None:
    env = daemon_env(tmp_path, s3_bucket=s3.bucket, s3_endpoint=s3.url) | {
        k: v for k, v in AWS_ENV.items() if not k.startswith("AWS_ACCESS") and not k.startswith("AWS_SECRET")
    }
    one_line(start_up(tmp_path, env), f"s3_bucket={s3.bucket!r}", "no S3 credentials found", "AWS_ACCESS_KEY_ID")


def _get(url: str, token: str | None = None) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, json.loads(r.read())


@pytest.mark.parametrize("workers", [1, 2])
def test_an_endpoint_that_does_not_answer_is_served_around_and_said(tmp_path: Path, workers: int) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = daemon_env(tmp_path, s3_bucket="a-bucket", s3_endpoint=dead, workers=str(workers)) | AWS_ENV
    d = Daemon(tmp_path / "data", free_port(), env)
    d.start(timeout=120)
    try:
        deadline = time.monotonic() + 30
        while True:  # (a reader worker reads the writer's view, at most half a second old)
            status, ready = _get(d.base + "/readyz")
            if "object_tier" in ready or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200 and ready["status"] == "ready", ready
        assert ready["object_tier"] == {"reachable": False, "since": ready["object_tier"]["since"]}  # type: ignore[index]
        _, admin = _get(d.base + "/v1/admin/status", ADMIN)
        tier = admin["object_tier"]
        assert isinstance(tier, dict) and tier["reachable"] is False and dead.removeprefix("http://") in tier["error"]
        said = subprocess.run(
            [sys.executable, "-m", "kvstore", "admin", "status", "--url", d.base, "--token", ADMIN],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert said.returncode == 0 and "UNREACHABLE since" in said.stdout, said.stdout + said.stderr
        # Local data is served meanwhile.
        req = urllib.request.Request(
            d.base + "/v1/admin/tenants",
            data=json.dumps({"name": "t", "durability": "persistent"}).encode(),
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            token = json.loads(r.read())["token"]
        put = urllib.request.Request(
            d.base + "/v1/blocks/k", data=b"x" * 8192, method="PUT", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(put, timeout=30) as r:
            assert r.status == 201
    finally:
        assert d.stop() == 0
    # The stop says what is not uploaded: the sealed segment (an ERROR: a node that never returns loses it),
    # never a false "0 sealed segments".
    assert "0 sealed segments (0 bytes)" not in d.output

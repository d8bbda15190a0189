"""deploy/fleet/run-local-fleet.sh, the local recipe of docs/fleet.md: it
starts moto's S3 server and N nodes on 127.0.0.1, prints their URLs and the
admin token once every node is ready and sees the others alive, and a
Ctrl-C stops every process it started. Run for real with two nodes (about
10 s on 2 cores); needs the checkout's .venv (deploy/setup-venv.sh test)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kvstore.server_config import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "fleet" / "run-local-fleet.sh"
pytestmark = pytest.mark.timeout(180)


def test_bad_arguments_are_refused_in_one_line() -> None:
    for args, said in (
        (["--moto-port", "99999"], "--moto-port 99999: expected a port"),
        (["--moto-port"], "--moto-port needs a port"),
        (["--bogus"], "unknown option --bogus"),
        (["0"], "N=0: expected 1 to 99 nodes"),
    ):
        out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and said in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr


def test_the_script_parses_and_sets_only_real_settings() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    named = set(re.findall(r"\bKVSTORE_([A-Z0-9_]+)=", text))
    assert {"FLEET", "S3_BUCKET", "S3_ENDPOINT", "NODE_ID", "ADVERTISE_URL"} <= named
    assert all(n.lower() in SETTINGS for n in named), sorted(n for n in named if n.lower() not in SETTINGS)


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            socks = []
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no consecutive free ports")


def test_two_nodes_start_answer_and_stop_on_ctrl_c(tmp_path: Path) -> None:
    if not (ROOT / ".venv" / "bin" / "kvstore").exists():
        pytest.skip("needs the checkout's .venv (deploy/setup-venv.sh test)")
    port = _free_ports(2)
    moto = _free_ports(1)  # (used to be: moto's port could not be chosen)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "FLEET_DIR": str(tmp_path / "fleet"),
        "FLEET_PORT": str(port),
        "KVSTORE_FLEET_HEARTBEAT_S": "0.5",
        "KVSTORE_FLEET_DEAD_AFTER_S": "2.5",
    }
    log = tmp_path / "out.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), "--moto-port", str(moto), "2"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        said = log.read_text()
        token = (tmp_path / "fleet" / "admin.token").read_text().strip()
        assert f"admin token: {token}" in said
        assert (tmp_path / "fleet" / "s3.url").read_text().strip() == f"http://127.0.0.1:{moto}"
        assert f"moto's S3 server at http://127.0.0.1:{moto}" in said
        urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
        for i, url in enumerate(urls):
            assert f"node-{i}  {url}" in said, said
        assert "members (GET /v1/fleet, version" in said and "node-0 alive, node-1 alive" in said, said
        req = urllib.request.Request(urls[1] + "/v1/fleet", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            view = json.loads(r.read())
        assert sorted((n["id"], n["state"], n["url"]) for n in view["nodes"]) == [
            ("node-0", "alive", urls[0]),
            ("node-1", "alive", urls[1]),
        ]
        os.killpg(proc.pid, signal.SIGINT)  # a Ctrl-C: the terminal signals the whole group
        assert proc.wait(60) == 130, log.read_text()
        assert "stopped" in log.read_text()
        time.sleep(0.5)
        left = subprocess.run(["ps", "-o", "pid,stat,cmd", "-g", str(proc.pid)], capture_output=True, text=True)
        assert not _group_alive(proc.pid), left.stdout  # nothing it started is left, not even a zombie
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True

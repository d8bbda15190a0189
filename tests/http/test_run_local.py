"""deploy/run-local.sh, the README's first command.

Used to be: its documented ``--listen 127.0.0.1:9000`` added a second
address beside the default 127.0.0.1:8420 instead of replacing it.

The script runs from a copy of deploy/ whose setup step links this
checkout's .venv (the real setup, a pip install, is what tests/run.sh does
already); the daemon it starts is the real one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.http.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_listen_replaces_the_default_address(tmp_path: Path) -> None:
    tree = tmp_path / "checkout"
    (tree / "deploy").mkdir(parents=True)
    shutil.copy2(ROOT / "deploy" / "run-local.sh", tree / "deploy" / "run-local.sh")
    setup = tree / "deploy" / "setup-venv.sh"
    setup.write_text(f'#!/bin/sh\nln -sfn "{ROOT / ".venv"}" "$(dirname "$0")/../.venv"\n')
    setup.chmod(0o755)
    port = free_port()
    log = tmp_path / "run-local.log"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "KVSTORE_WORKERS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(tree / "deploy" / "run-local.sh"), "--listen", f"127.0.0.1:{port}"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "kvstore serving on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    (line,) = [x for x in log.read_text().splitlines() if x.startswith("kvstore serving on")]
    assert line == f"kvstore serving on http://127.0.0.1:{port}", line
    assert (tree / "local" / "data").is_dir()  # the other default still holds
    assert (tree / "local" / "admin.token").stat().st_mode & 0o077 == 0

"""Running ``kvstore admin`` as an operator does: the installed command, a
process of its own, the daemon's URL and the admin token in its
environment (tests/http/test_admin_cli.py, tests/fleet/test_admin_wait.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.http.conftest import ADMIN, ROOT

INSTALLED = Path(sys.executable).with_name("kvstore")  # the venv's entry point (pyproject's [project.scripts])


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def doc(self) -> Any:
        """The ``--json`` answer of a command that succeeded."""
        assert self.code == 0, (self.code, self.err)
        return json.loads(self.out)


def admin(url: str, *args: str, token: str | None = ADMIN, **env: str) -> Ran:
    """``kvstore admin ARGS`` with KVSTORE_URL=``url`` and KVSTORE_ADMIN_TOKEN=``token`` (None: unset)."""
    cmd = [str(INSTALLED)] if INSTALLED.exists() else [sys.executable, "-m", "kvstore"]
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "KVSTORE_URL": url, **env}
    if token is not None:
        environ["KVSTORE_ADMIN_TOKEN"] = token
    p = subprocess.run([*cmd, "admin", *args], env=environ, capture_output=True, text=True, timeout=120)
    return Ran(p.returncode, p.stdout, p.stderr)


def failed(ran: Ran, code: int, *words: str) -> None:
    """The command failed with exit status ``code`` and one line of error,
    the last on stderr, naming ``words`` (a note may come before it: a
    change made, its token shown, before a --wait that timed out)."""
    assert ran.code == code, (ran.code, ran.out, ran.err)
    lines = ran.err.strip().splitlines()
    errors = [line for line in lines if line.startswith("kvstore admin: ")]
    assert errors == lines[-1:], ran.err
    for w in words:
        assert w in errors[0], (w, errors[0])
    assert "Traceback" not in ran.err

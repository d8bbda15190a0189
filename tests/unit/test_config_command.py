"""``kvstore config`` (kvstore/config_report.py): the settings a start would
use and where each came from, secrets never shown, refused as start-up
refuses them, and nothing opened or bound.

Used to be: no way to see the effective configuration short of starting
the daemon, nor to tell which of the file, a variable or a flag set a value.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from kvstore.server_config import SECRETS, SETTINGS

ROOT = Path(__file__).resolve().parents[2]
MASTER = os.urandom(32).hex()
ADMIN = "an-admin-token-that-is-long-enough-0123456789"


def kvstore(*args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """``kvstore ARGS`` with a master key and ``env`` (None: variable unset)."""
    base: dict[str, str | None] = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "KVSTORE_MASTER_KEY": MASTER,
    }
    full = {k: v for k, v in (base | (env or {})).items() if v is not None}
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], env=full, capture_output=True, text=True, timeout=60
    )


def _rows(text: str) -> dict[str, tuple[str, str]]:
    """setting -> (value, source) of the table."""
    out = {}
    for line in text.splitlines()[3:]:
        name, rest = line.split(None, 1)
        value, _, source = rest.rpartition("  ")
        out[name] = (value.strip(), source.strip())
    return out


def test_every_setting_with_its_value_and_source(tmp_path: Path) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text('durability = "interval"\nsegment_size = "64MiB"\nworkers = 3\n')
    data_dir = tmp_path / "not-yet" / "data"
    env = {"KVSTORE_WORKERS": "2", "KVSTORE_ADMIN_TOKEN": ADMIN}
    out = kvstore("config", "--config", str(toml), "--data-dir", str(data_dir), "--log-format", "json", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"config file: {toml}"
    rows = _rows(out.stdout)
    assert list(rows) == list(SETTINGS)
    assert rows["durability"] == ('"interval"', f"file {toml}")
    assert rows["segment_size"] == ("67108864 (64 MiB)", f"file {toml}")
    assert rows["workers"] == ("2", "environment KVSTORE_WORKERS")
    assert rows["log_format"] == ('"json"', "flag --log-format")
    assert rows["data_dir"] == (json.dumps(str(data_dir)), "flag --data-dir")
    assert rows["listen"] == ('"127.0.0.1:8420"', "default")
    assert rows["unix_socket_mode"] == ("0o660", "default")
    assert rows["admin_token"] == ("(set)", "environment KVSTORE_ADMIN_TOKEN")
    assert rows["master_key"] == ("(set)", "environment KVSTORE_MASTER_KEY")
    assert rows["metrics_token"] == ("(unset)", "default")
    assert ADMIN not in out.stdout + out.stderr and MASTER not in out.stdout + out.stderr
    assert not data_dir.parent.exists(), "kvstore config made the data directory"

    doc = json.loads(kvstore("config", "--json", "--config", str(toml), env=env).stdout)
    assert doc["config_file"] == str(toml) and list(doc["settings"]) == list(SETTINGS)
    assert doc["settings"]["workers"] == {"value": 2, "source": "environment", "from": "KVSTORE_WORKERS"}
    assert doc["settings"]["segment_size"] == {"value": 64 << 20, "source": "file", "from": str(toml)}
    assert doc["settings"]["listen"] == {"value": "127.0.0.1:8420", "source": "default", "from": None}
    assert {name: doc["settings"][name]["value"] for name in SECRETS} == {
        "admin_token": "(set)",
        "master_key": "(set)",
        "metrics_token": "(unset)",
    }


def test_refused_as_start_up_refuses_with_the_same_line(tmp_path: Path) -> None:
    """The same one line and exit status 2 as ``kvstore serve`` given the
    same settings (serve stops there, before it opens or binds anything)."""
    toml = tmp_path / "kvstore.toml"
    toml.write_text('durablity = "interval"\n')
    cases: list[tuple[list[str], dict[str, str | None], str]] = [
        ([], {"KVSTORE_DURABLITY": "interval"}, "did you mean KVSTORE_DURABILITY?"),
        (["--config", str(toml)], {}, "unknown key 'durablity'; did you mean 'durability'?"),
        (["--listen", "127.0.0.1:8420", "--listen", "127.0.0.1:99999"], {}, "the port 99999 is out of range"),
        ([], {"KVSTORE_ADMIN_TOKEN": "replace-with-a-long-random-token-0123456789"}, "the example's placeholder"),
        ([], {"KVSTORE_MASTER_KEY": None}, "no master key"),
        (["--data-dir", str(toml / "data")], {}, "is not a directory"),
    ]
    for args, env, why in cases:
        config = kvstore("config", *args, env=env)
        serve = kvstore("serve", *args, env=env)
        assert config.returncode == 2 and config.stdout == "", (args, env, config)
        assert len(config.stderr.splitlines()) == 1 and why in config.stderr, config.stderr
        assert config.stderr == serve.stderr and serve.returncode == 2


def test_neither_binds_nor_opens(tmp_path: Path) -> None:
    """A port in use and a data directory in use by a running daemon are no
    reason to refuse: nothing is bound, nothing opened."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data_dir = tmp_path / "data"
        data_dir.mkdir()
        out = kvstore("config", "--listen", f"127.0.0.1:{port}", "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stderr
    assert list(data_dir.iterdir()) == []

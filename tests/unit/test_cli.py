"""The ``kvstore`` command (kvstore/cli.py): one entry point, a version, and
``--help`` that says what every flag means and its default.

Used to be: no command (``server.py`` was not installed), no ``--version``,
and ``server.py --help`` listed ~80 flags as ``VALUE`` with no meaning or default.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from kvstore import __version__
from kvstore.server_config import SECRETS, SETTINGS
from kvstore.settings_doc import parse, settings_text, shipped

ROOT = Path(__file__).resolve().parents[2]


def kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=60)


def test_version_is_the_distributions() -> None:
    out = kvstore("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvstore {__version__}"
    assert metadata.version("kvstore-server") == __version__
    assert kvstore("serve", "--version").stdout.strip() == f"kvstore {__version__}"


def test_help_lists_the_commands_and_a_wrong_one_is_refused() -> None:
    out = kvstore("--help")
    assert out.returncode == 0
    assert "serve" in out.stdout and "fsck" in out.stdout
    bad = kvstore("serv")
    assert bad.returncode == 2 and "invalid choice: 'serv'" in bad.stderr
    assert kvstore().returncode == 2


def test_serve_help_gives_every_flag_its_meaning_and_default() -> None:
    out = kvstore("serve", "--help")
    assert out.returncode == 0
    public = [name for name in SETTINGS if name not in SECRETS]
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for name in public:
        flag = "--" + name.replace("_", "-")
        m = re.search(
            re.escape(flag) + r" (VALUE|ADDRESS) (.*?)\(((?:default: |unset by default)[^)]*?)env KVSTORE_", text
        )
        assert m, f"{flag}: no help with a default"
        assert len(m[2].strip()) > 10, f"{flag}: no meaning"
    assert "undocumented" not in out.stdout


def test_every_setting_is_documented_in_the_shipped_file() -> None:
    docs = shipped()
    public = {name for name in SETTINGS if name not in SECRETS}
    assert set(docs) == public
    assert all(doc.text for doc in docs.values()), [d.name for d in docs.values() if not d.text]
    # The checkout's deploy/kvstore.toml is that same file.
    assert (ROOT / "deploy" / "kvstore.toml").read_text() == settings_text()


def test_settings_doc_parses_blocks() -> None:
    text = '# --- \n# Server\n# ---\n\n# What a does.\n# a = 1\n# b = 2\n\n# c\'s meaning.\n# e.g. c = "x"\n'
    docs = parse(text)
    assert docs["a"].text == "What a does." and docs["a"].default == "1"
    assert docs["b"].text == "What a does."  # shares the block above the first
    assert docs["c"].default is None and docs["c"].example == '"x"'


def test_fsck_is_a_subcommand() -> None:
    out = kvstore("fsck", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: kvstore fsck")
    missing = kvstore("fsck", "--data-dir", "/nonexistent/kvstore-data")
    assert missing.returncode == 2 and missing.stderr.startswith("kvstore fsck: ")


def test_server_py_is_the_same_command() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "server.py"), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"kvstore {__version__}"

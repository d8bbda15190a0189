"""Every --help reads as an operator's page: what the command does first,
no reStructuredText markup (double backticks were printed as they are).

Used to be: 'kvstore serve --help' opened with its module's docstring,
"kvstore daemon: argv -> config -> event loop -> app.", with ``RST``
backticks, after fifty lines of usage."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from kvstore.cli import COMMANDS, command_parser, parser

ROOT = Path(__file__).resolve().parents[2]


def _all(p: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``p`` and every parser under it (admin's nested commands)."""
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _all(sub)


def test_no_help_has_a_backtick() -> None:
    pages = {"kvstore": parser().format_help()}
    for name in COMMANDS:
        for p in _all(command_parser(name)):
            pages[p.prog] = p.format_help()
    assert {"kvstore serve", "kvstore fsck", "kvstore config"} <= set(pages)
    marked = sorted(prog for prog, text in pages.items() if "`" in text)
    assert not marked, f"backticks in the --help of {marked}"


def test_serve_help_opens_with_what_it_does_for_an_operator() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--help"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "usage: kvstore serve [-h] [--version] [--config FILE] [--SETTING VALUE ...]"
    assert lines[2] == "Run the kvstore daemon, serving KV-cache blocks to inference engines."
    assert "argv -> config" not in out.stdout and "``" not in out.stdout
    for words in ("exit status:", "SIGTERM", "KVSTORE_MASTER_KEY_FILE", "kvstore config"):
        assert words in out.stdout, words


def test_each_command_says_what_it_does_first() -> None:
    for name in ("serve", "fsck", "config"):
        own = command_parser(name)
        assert own.description and own.epilog and "exit status:" in own.epilog, name
        first = own.description.splitlines()[0]
        assert first[0].isupper() and first.endswith("."), (name, first)

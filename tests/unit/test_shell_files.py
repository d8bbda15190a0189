"""Shell completion and the man page (deploy/share/, made by
deploy/shell_files.py with shtab and argparse-manpage) are the parsers' own:
regenerated here and compared, so a flag or a command added without
regenerating fails. Every command of kvstore.cli.COMMANDS is in them,
including those added after this test was written."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from kvstore.cli import COMMANDS, command_parser

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shell_files", ROOT / "deploy" / "shell_files.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_files_are_what_the_parsers_generate() -> None:
    gen = _generator()
    files: dict[str, str] = gen.generate()
    stale = [rel for rel, text in files.items() if (gen.SHARE / rel).read_text() != text]
    assert not stale, f"{stale} are stale: run .venv/bin/python deploy/shell_files.py and commit deploy/share/"


def test_every_command_and_flag_is_in_them() -> None:
    gen = _generator()
    bash = (gen.SHARE / gen.BASH).read_text()
    zsh = (gen.SHARE / gen.ZSH).read_text()
    man = (gen.SHARE / gen.MAN).read_text()
    assert f"_shtab_kvstore_subparsers=({' '.join(COMMANDS)})" in bash
    for name in COMMANDS:
        assert f"'kvstore {name}'" in man, name
        assert f"\n    {name}:'" in zsh, name
        for action in command_parser(name)._actions:
            for option in action.option_strings:
                assert option in bash, (name, option)
    assert "_shtab_compgen_dirs" in bash  # --data-dir completes directories, --config files
    assert man.startswith('.TH KVSTORE "1" "" "kvstore" "kvstore manual"')  # no date nor version: no drift

"""Shell completion (bash, zsh) and the man page of the ``kvstore`` command,
generated from its parsers with shtab and argparse-manpage.

    .venv/bin/python deploy/shell_files.py          write them under deploy/share/
    .venv/bin/python deploy/shell_files.py --check  exit 1 if a committed one is stale

The files are committed (deploy/share/, laid out as they install) and
shipped in the wheel as data files (pyproject.toml), so that building the
wheel needs neither the daemon's dependencies nor these two libraries: a pip
install puts them under the environment's share/ (bash-completion and man
look there when its bin/ is on PATH; the container image links them into
/usr/local/share). tests/unit/test_shell_files.py regenerates them and fails
on any difference: a flag or command added without regenerating.

The parsers are kvstore.cli.parser(full=True): the top-level command with
every command of kvstore.cli.COMMANDS and its own flags, whatever commands
are added there later. Help is formatted at 80 columns whatever the
terminal; run it with the project's Python (3.11: argparse's layout changes
between versions) and the pinned shtab and argparse-manpage (pyproject.toml's
test extra), so the output is the same on every machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARE = ROOT / "deploy" / "share"
BASH = "bash-completion/completions/kvstore"
ZSH = "zsh/site-functions/_kvstore"
MAN = "man/man1/kvstore.1"
# Flags that name a file or a directory: completed as paths.
DIRECTORIES = ("--data-dir", "--tier-dir")
FILES = ("--config", "--tls-cert", "--tls-key", "--master-key-file", "--admin-token-file", "--metrics-token-file")


@contextlib.contextmanager
def _columns(n: int) -> Iterator[None]:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(n)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def _parsers(p: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases name one parser
                yield from _parsers(sub)


def _mark_paths(p: argparse.ArgumentParser) -> None:
    """shtab completes these flags' values as paths (its ``complete``
    attribute; the runtime parsers know nothing of shtab)."""
    import shtab

    for parser in _parsers(p):
        for action in parser._actions:
            options = set(action.option_strings)
            if options & set(DIRECTORIES):
                action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
            elif options & set(FILES) or action.metavar == "FILE" or any(o.endswith("-file") for o in options):
                action.complete = shtab.FILE  # type: ignore[attr-defined]


def generate() -> dict[str, str]:
    """Each file's path under deploy/share/ and its text."""
    import shtab
    from argparse_manpage.manpage import Manpage

    sys.path.insert(0, str(ROOT))
    from kvstore.cli import parser

    with _columns(80):
        p = parser(full=True)
        _mark_paths(p)
        bash = shtab.complete(p, shell="bash")
        zsh = shtab.complete(p, shell="zsh")
        man = Manpage(p)
        man.date = ""  # no date or version: the page changes only when a parser does
        man.source = "kvstore"
        man.manual = "kvstore manual"
        man.description = "a storage daemon for LLM KV-cache blocks"
        page = str(man)
    return {BASH: bash, ZSH: zsh, MAN: page}


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: shell_files.py [--check]", file=sys.stderr)
        return 2
    stale = []
    for rel, text in generate().items():
        path = SHARE / rel
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path.relative_to(ROOT))
    if stale:
        print(f"stale: {', '.join(stale)}; run: .venv/bin/python deploy/shell_files.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

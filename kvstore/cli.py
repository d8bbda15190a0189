"""The ``kvstore`` command: one entry point for what the daemon's wheel installs.

    kvstore serve [FLAGS]      run the daemon (kvstore/daemon/; server.py in a checkout)
    kvstore fsck --data-dir D  check a stopped node's data directory (kvstore/fsck.py)
    kvstore admin COMMAND      manage a running daemon over its admin API (kvstore/admin/)
    kvstore --version

Each subcommand has its own ``--help``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kvstore import __version__


def _serve(argv: list[str]) -> int:
    from kvstore.daemon import main

    return main(argv, prog="kvstore serve")


def _admin(argv: list[str]) -> int:
    from kvstore.admin import main

    return main(argv, prog="kvstore admin")


def _fsck(argv: list[str]) -> int:
    from kvstore.fsck import main

    return main(argv, prog="kvstore fsck")


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "serve": (_serve, "run the daemon: every setting is a flag, a KVSTORE_* variable or a key of --config"),
    "fsck": (_fsck, "check (or --repair) a data directory offline, with the daemon stopped"),
    "admin": (_admin, "manage a running daemon: tenants, tokens, S3 keys, status, flush, compact, verify"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore",
        description="kvstore: a storage daemon for LLM KV-cache blocks.",
        epilog="'kvstore COMMAND --help' lists a command's flags, each with its meaning and default.",
    )
    p.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in COMMANDS:  # the subcommand parses its own flags
        run, _ = COMMANDS[args[0]]
        return run(args[1:])
    parser().parse_args(args)  # --help, --version, or an error naming the commands (exit 2)
    return 2

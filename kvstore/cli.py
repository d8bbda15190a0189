"""The ``kvstore`` command: one entry point for what the daemon's wheel installs.

    kvstore serve [FLAGS]      run the daemon (kvstore/daemon/; server.py in a checkout)
    kvstore fsck --data-dir D  check a stopped node's data directory (kvstore/fsck.py)
    kvstore admin COMMAND      manage a running daemon over its admin API (kvstore/admin/)
    kvstore config [FLAGS]     the settings serve would use, and where each came from (kvstore/config_report.py)
    kvstore --version

Each subcommand has its own ``--help``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

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


def _config(argv: list[str]) -> int:
    from kvstore.config_report import main

    return main(argv, prog="kvstore config")


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "serve": (_serve, "run the daemon: every setting is a flag, a KVSTORE_* variable or a key of --config"),
    "fsck": (_fsck, "check (or --repair) a data directory offline, with the daemon stopped"),
    "admin": (_admin, "manage a running daemon: tenants, tokens, S3 keys, status, flush, compact, verify"),
    "config": (_config, "show the settings serve would start with, and where each came from"),
}


def parser(full: bool = False) -> argparse.ArgumentParser:
    """The top-level parser. ``full``: with every command's own flags (caught
    by :func:`command_parser`), for shell completion and the man page."""
    p = argparse.ArgumentParser(
        prog="kvstore",
        description="kvstore: a storage daemon for LLM KV-cache blocks.",
        epilog="'kvstore COMMAND --help' lists a command's flags, each with its meaning and default.",
    )
    p.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, text) in COMMANDS.items():
        if not full:
            sub.add_parser(name, help=text, add_help=False)
            continue
        own = command_parser(name)
        sub.add_parser(
            name,
            help=text,
            parents=[own],
            add_help=False,  # the parent's -h is copied
            description=own.description,
            epilog=own.epilog,
            formatter_class=own.formatter_class,
        )
    return p


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser that command ``name`` of :data:`COMMANDS` builds, caught as
    it starts to parse (nothing runs): each command builds its own in its
    module, and this finds every one, including commands added later."""

    def catch(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> NoReturn:
        raise _Caught(self)

    run, _ = COMMANDS[name]
    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = catch  # type: ignore[method-assign]
    try:
        run([])
    except _Caught as e:
        return e.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved  # type: ignore[method-assign]
    raise RuntimeError(f"kvstore {name} returned without parsing its arguments")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in COMMANDS:  # the subcommand parses its own flags
        run, _ = COMMANDS[args[0]]
        return run(args[1:])
    parser().parse_args(args)  # --help, --version, or an error naming the commands (exit 2)
    return 2

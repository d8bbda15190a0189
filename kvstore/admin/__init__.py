"""``kvstore admin``: the operator's command for a running daemon.

Tenants (create, list with their usage and hits, show, patch, delete,
rotate-key), their tokens and S3 keys, the daemon's status, and flush,
compact and verify, over the daemon's admin API (docs/API.md) with the
admin token. Human tables by default, ``--json`` for scripts; every
failure one line on stderr and an exit status (errors.py). On a fleet,
``--wait`` returns once a change is in force on every alive node
(wait.py).

The package is a client of the API: it imports nothing of the daemon
(tests/unit/test_layers.py), only the standard library.

- ``parser``: the flags and subcommands, and their help;
- ``commands``: what each subcommand asks, and how its answer reads;
- ``client``: HTTP(S) calls and the errors they become;
- ``wait``: ``--wait`` on a fleet;
- ``render``: tables and units for a person;
- ``values``: flag values (sizes, durations, none/default);
- ``errors``: failures and exit statuses.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from kvstore.admin.client import Client
from kvstore.admin.errors import OK, AdminError, UsageError
from kvstore.admin.parser import DEFAULT_TIMEOUT_S, DEFAULT_URL, build
from kvstore.admin.wait import wait_for

URL_VARIABLE = "KVSTORE_URL"
TOKEN_VARIABLE = "KVSTORE_ADMIN_TOKEN"
TOKEN_FILE_VARIABLE = "KVSTORE_ADMIN_TOKEN_FILE"  # the daemon's own setting, read the same way


def main(
    argv: list[str] | None = None,
    prog: str = "kvstore admin",
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run one admin command; its exit status (errors.py)."""
    env = os.environ if env is None else env
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        return _run(sys.argv[1:] if argv is None else argv, prog, env, out, err)
    except AdminError as e:
        print(f"kvstore admin: {e}", file=err)
        return e.status
    except KeyboardInterrupt:
        print("kvstore admin: interrupted", file=err)
        return 130
    except BrokenPipeError:  # the reader of the output went away (| head): nothing more to say
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())  # (so that the exit's flush is quiet)
        return OK


def _run(argv: list[str], prog: str, env: Mapping[str, str], out: TextIO, err: TextIO) -> int:
    args = build(prog).parse_args(argv)
    as_json = getattr(args, "json", False)
    client = Client(url_of(args, env), token_of(args, env), getattr(args, "timeout", DEFAULT_TIMEOUT_S))
    outcome = args.run(client, args)
    if as_json:
        print(json.dumps(outcome.doc, indent=1, sort_keys=True), file=out)
    else:
        print(outcome.text, file=out)
        if outcome.note:
            print(outcome.note, file=err)
    out.flush()  # (what the change printed, a token shown once, is out before any wait)
    if getattr(args, "wait", False) and outcome.revision is not None:
        say = (lambda _: None) if as_json else (lambda line: print(line, file=err))
        wait_for(client, outcome.revision, getattr(args, "wait_timeout", None), say)
    if outcome.failure is not None:
        raise outcome.failure
    return OK


def url_of(args: object, env: Mapping[str, str]) -> str:
    """--url, else KVSTORE_URL, else the daemon's default address."""
    return str(getattr(args, "url", None) or env.get(URL_VARIABLE) or DEFAULT_URL)


def token_of(args: object, env: Mapping[str, str]) -> str:
    """--token, --token-file, KVSTORE_ADMIN_TOKEN, KVSTORE_ADMIN_TOKEN_FILE: the first given."""
    token = getattr(args, "token", None)
    if token is not None:
        if not token.strip():
            raise UsageError("--token is empty")
        return str(token).strip()
    path = getattr(args, "token_file", None)
    if path is not None:
        return _read_token(path, "--token-file")
    if env.get(TOKEN_VARIABLE, "").strip():
        return env[TOKEN_VARIABLE].strip()
    if env.get(TOKEN_FILE_VARIABLE):
        return _read_token(env[TOKEN_FILE_VARIABLE], TOKEN_FILE_VARIABLE)
    raise UsageError(
        f"no admin token: give --token-file FILE (or --token), or set {TOKEN_VARIABLE} or {TOKEN_FILE_VARIABLE}"
    )


def _read_token(path: str, source: str) -> str:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UsageError(f"{source} {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{source} {path}: not a text file") from None
    token = lines[0].strip() if lines else ""
    if not token:
        raise UsageError(f"{source} {path}: its first line is empty; expected the admin token")
    return token

"""The admin command's flags and subcommands (argparse), and their help.

Every flag that says how to reach the daemon or how to answer (``--url``,
``--token``, ``--json``, ``--wait`` ...) may come before the subcommand or
after it. A wrong flag or value is one line and exit status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from kvstore.admin import commands
from kvstore.admin.errors import UsageError
from kvstore.admin.values import COUNT, SECONDS, SIZE, count, or_null, seconds, size, text_or_null

DEFAULT_URL = "http://127.0.0.1:8420"  # the daemon's default listen address (kvstore serve --listen)
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_FLUSH_TIMEOUT_S = 600.0

EXIT_STATUSES = """\
exit status:
  0  done (with --wait: in force on every alive node of the fleet)
  1  the daemon refused the call or reported a failure (its error code and message
     are shown; a refused admin token says so)
  2  a wrong flag, value, URL or token: nothing was sent
  3  the daemon could not be reached at the URL, or its answer was not the API's
  4  --wait: the change was made, but not every alive node held it in time (they are named)
  5  verify found damage"""

CONNECTION = """\
The daemon's URL is --url, else the variable KVSTORE_URL, else http://127.0.0.1:8420.
The admin token is --token or the first line of --token-file, else the variable
KVSTORE_ADMIN_TOKEN, else the file the variable KVSTORE_ADMIN_TOKEN_FILE names."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line and exit status 2 (UsageError)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _common(p: argparse.ArgumentParser) -> None:
    """The flags every subcommand takes, before or after it (SUPPRESS: a
    flag not given on one level leaves what the other level set)."""
    g = p.add_argument_group("reaching the daemon, and answering")
    s = argparse.SUPPRESS
    g.add_argument("--url", default=s, help="the daemon's URL, http://HOST:PORT or https://HOST:PORT")
    g.add_argument(
        "--token",
        default=s,
        help="the admin token (other users of this machine can see it in the process list: "
        "prefer --token-file or KVSTORE_ADMIN_TOKEN)",
    )
    g.add_argument("--token-file", default=s, metavar="FILE", help="a file whose first line is the admin token")
    g.add_argument("--json", action="store_true", default=s, help="print the daemon's answer as JSON, for scripts")
    g.add_argument(
        "--wait",
        action="store_true",
        default=s,
        help="on a fleet, after a change of tenants, tokens or S3 keys: wait until every alive node "
        "holds it (off a fleet, and for other commands, there is nothing to wait for)",
    )
    g.add_argument(
        "--wait-timeout",
        type=float,
        default=s,
        metavar="SECONDS",
        help="how long --wait waits (default: five heartbeats of the fleet, at least 5 seconds)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=s,
        metavar="SECONDS",
        help=f"how long to wait for each answer (default {DEFAULT_TIMEOUT_S:g}; compact and verify wait as long as "
        "they take)",
    )


def _limits(p: argparse.ArgumentParser) -> None:
    """A tenant's limits, QoS and admission (create and patch)."""
    g = p.add_argument_group("limits (each: a value, or none / default for no limit or the store's default)")
    g.add_argument(
        "--quota",
        type=or_null(size, SIZE, "none"),
        metavar="SIZE",
        help="the bytes it may store, e.g. 10GiB (none: none)",
    )
    g.add_argument(
        "--ttl",
        type=or_null(seconds, SECONDS, "none"),
        metavar="SECONDS",
        help="how long a block lives after it is written, e.g. 3600, 12h or 7d (none: for ever)",
    )
    g.add_argument(
        "--frame-size",
        type=or_null(size, SIZE, "default"),
        metavar="SIZE",
        help="plaintext bytes per frame of its new records, a multiple of 4KiB (default: the store's)",
    )
    g.add_argument(
        "--events-topic",
        type=text_or_null,
        metavar="TOPIC",
        help="the topic of its residency events (default: its name)",
    )
    q = p.add_argument_group("quality of service (each: a value, or default for the store's)")
    q.add_argument(
        "--weight", type=or_null(count, COUNT, "default"), metavar="N", help="its share of a busy node, 1 to 1000"
    )
    q.add_argument(
        "--read-bytes-per-s",
        type=or_null(size, SIZE, "default"),
        metavar="SIZE",
        help="its read limit a second (0: none)",
    )
    q.add_argument(
        "--write-bytes-per-s",
        type=or_null(size, SIZE, "default"),
        metavar="SIZE",
        help="its write limit a second (0: none)",
    )
    q.add_argument(
        "--requests-per-s",
        type=or_null(count, COUNT, "default"),
        metavar="N",
        help="its request limit a second (0: none)",
    )
    q.add_argument("--qos-defaults", action="store_true", help="put every QoS field back to the store's default")
    a = p.add_argument_group("admission and eviction (each: a value, or default)")
    a.add_argument(
        "--admit-after",
        type=or_null(count, COUNT, "default"),
        metavar="N",
        help="store a new block only at its N-th offer, 1 to 16 (default 1: at its first)",
    )
    a.add_argument(
        "--admit-window",
        type=or_null(seconds, SECONDS, "default"),
        metavar="SECONDS",
        help="how long a block's offers count towards --admit-after (default 1h)",
    )
    a.add_argument(
        "--eviction",
        type=text_or_null,
        metavar="POLICY",
        help="which blocks its quota takes: lru or probation (default: the node's quota_eviction)",
    )


def _leaf(
    sub: argparse._SubParsersAction[Parser], name: str, run: commands.Command, text: str, description: str = ""
) -> Parser:
    p = sub.add_parser(
        name,
        help=text,
        description=description or text[:1].upper() + text[1:] + ".",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    p.set_defaults(run=run)
    return p


def build(prog: str = "kvstore admin") -> Parser:
    p = Parser(
        prog=prog,
        description="Manage a running kvstore daemon: its tenants, their tokens and S3 keys,\n"
        "its status and maintenance.\n\n" + CONNECTION,
        epilog="'kvstore admin COMMAND --help' lists a command's actions or flags.\n\n" + EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    groups = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    tenants = groups.add_parser("tenants", help="create, list, show, change and delete tenants")
    t = tenants.add_subparsers(dest="action", metavar="ACTION", required=True)
    _leaf(t, "list", commands.tenants_list, "every tenant with its blocks, bytes, quota, TTL and hits")
    _leaf(t, "show", commands.tenants_show, "one tenant: its settings, usage, rates and hits").add_argument("name")
    create = _leaf(
        t,
        "create",
        commands.tenants_create,
        "create a tenant and its first token",
        "Create a tenant and its first token. The token alone is printed on standard output (it is shown "
        "once: keep it), so that TOKEN=$(kvstore admin tenants create NAME) captures it.",
    )
    create.add_argument("name")
    create.add_argument(
        "--policy",
        choices=("sealed", "direct"),
        default="sealed",
        help="sealed: compressed and encrypted (the default); direct: stored as written, for zero-copy reads",
    )
    create.add_argument("--compression", choices=("zstd-bp2", "zstd", "none"), help="a sealed tenant's compression")
    create.add_argument(
        "--durability",
        choices=("persistent", "ephemeral"),
        help="persistent: kept in the object tier too; ephemeral: local disk only (default: the daemon's)",
    )
    _limits(create)
    patch = _leaf(
        t,
        "patch",
        commands.tenants_patch,
        "change a tenant's quota, TTL, frame size, events topic, QoS or admission",
        "Change a tenant's quota, TTL, frame size, events topic, QoS or admission; what is not given stays "
        "as it is. A lower quota is enforced before the answer. A tenant's policy, compression and durability "
        "are fixed at creation.",
    )
    patch.add_argument("name")
    _limits(patch)
    _leaf(
        t,
        "delete",
        commands.tenants_delete,
        "delete a tenant: its keys are destroyed at once, so its blocks can never be read again",
    ).add_argument("name")
    _leaf(
        t, "rotate-key", commands.tenants_rotate_key, "give a tenant a new data key for the records written from now on"
    ).add_argument("name")

    tokens = groups.add_parser("tokens", help="list, issue and revoke a tenant's bearer tokens")
    k = tokens.add_subparsers(dest="action", metavar="ACTION", required=True)
    _leaf(k, "list", commands.tokens_list, "a tenant's token ids").add_argument("tenant")
    _leaf(
        k,
        "issue",
        commands.tokens_issue,
        "issue another token of a tenant",
        "Issue another token of a tenant; the token alone is printed on standard output (it is shown once).",
    ).add_argument("tenant")
    revoke = _leaf(k, "revoke", commands.tokens_revoke, "revoke a token: it stops working at once")
    revoke.add_argument("tenant")
    revoke.add_argument("token_id", metavar="TOKEN_ID", help="the id 'tokens list' shows (not the token)")

    s3 = groups.add_parser("s3-keys", help="list, issue and revoke a tenant's access keys for the S3 gateway")
    s = s3.add_subparsers(dest="action", metavar="ACTION", required=True)
    _leaf(s, "list", commands.s3_keys_list, "a tenant's S3 access key ids").add_argument("tenant")
    issue = _leaf(s, "issue", commands.s3_keys_issue, "issue an S3 access key of a tenant (the secret is shown once)")
    issue.add_argument("tenant")
    revoke = _leaf(s, "revoke", commands.s3_keys_revoke, "revoke an S3 access key")
    revoke.add_argument("tenant")
    revoke.add_argument("access_key_id", metavar="ACCESS_KEY_ID")

    _leaf(
        groups,
        "status",
        commands.status,
        "the daemon's version, uptime, workers, disk, upload backlog, fence and fleet registry revision",
    )
    flush = _leaf(
        groups,
        "flush",
        commands.flush,
        "seal every open segment and, with an object tier, wait until every sealed one is in it",
    )
    flush.add_argument(
        "--upload-timeout",
        dest="flush_timeout",
        type=float,
        default=DEFAULT_FLUSH_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long the daemon waits for the uploads (default {DEFAULT_FLUSH_TIMEOUT_S:g})",
    )
    _leaf(groups, "compact", commands.compact, "run a compaction pass now and show what it did").add_argument(
        "--tenant", help="one tenant's segments only"
    )
    verify = _leaf(groups, "verify", commands.verify, "check every segment's records (exit status 5 if one is damaged)")
    verify.add_argument("--deep", action="store_true", help="also decrypt and decompress every frame")
    return p

"""``kvstore config``: the settings a start would use, and where each came from.

    kvstore config [--config FILE] [--json] [serve's flags]

Loads the settings exactly as ``kvstore serve`` does (one loader:
server_config.load_with_sources) from the same flags, the same variables
and the same file, and runs the checks start-up runs before it opens the
data directory: the tokens (admin_token_file, metrics_token_file: read,
never shown), the master key (its file's mode and owner), and data_dir
being a directory or creatable. A refusal is start-up's own one line on
stderr and exit status 2. Nothing is opened in the data directory and no
port is bound, so it can run beside a running daemon; run it as the
service's user to see what the service would see.

Secrets (admin_token, master_key, metrics_token) are shown as ``(set)`` or
``(unset)``, never their values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from kvstore.engine.api import load_master_key
from kvstore.errors import KVStoreError
from kvstore.server_config import (
    SECRETS,
    SETTINGS,
    ServerConfig,
    Source,
    check_data_dir,
    check_tokens,
    is_size,
    load_with_sources,
    setting_value,
)
from kvstore.settings_doc import add_setting_flags
from kvstore.workers import machine_workers

DESCRIPTION = """\
Show the settings 'kvstore serve' would start with, and where each came from.

Given the same flags, KVSTORE_* variables and TOML file as serve, it prints
each setting's value and its source: default, file, environment or flag.
Secrets show as (set) or (unset), never their values.

It refuses what start-up refuses, with the same one line and exit status 2,
without opening the data directory or binding a port: run it before a start
or a restart, as the service's user (sudo -u kvstore kvstore config ...)."""

EPILOG = """\
exit status:
  0   the settings are valid; they are printed
  2   start-up would refuse them: one line on stderr says which and why"""


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [-h] [--json] [--config FILE] [--SETTING VALUE ...]",  # serve's ~90 flags follow
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (setting: value, source) for scripts")
    add_setting_flags(p)
    return p


def effective(cfg: ServerConfig, sources: Mapping[str, Source]) -> dict[str, dict[str, Any]]:
    """Every setting's value (a secret's as "(set)"/"(unset)") and source."""
    out: dict[str, dict[str, Any]] = {}
    for name in SETTINGS:
        value = setting_value(cfg, name)
        if name in SECRETS:
            value = "(set)" if value else "(unset)"
        source = sources[name]
        out[name] = {"value": value, "source": source.kind, "from": source.where}
    return out


def _text_value(name: str, value: Any, cfg: ServerConfig) -> str:
    if name in SECRETS:
        return str(value)
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if name == "unix_socket_mode":
        return f"0o{value:03o}"
    if isinstance(value, int) and is_size(name):
        return f"{value} ({_human(value)})"
    if name == "workers" and value == "auto":
        return f'"auto" ({machine_workers(cfg).count} on this machine)'
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _human(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches (exact, or to a tenth)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}" if n % (1 << shift) == 0 else f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def render(cfg: ServerConfig, sources: Mapping[str, Source], config_file: str | None) -> str:
    """The settings as an aligned table: name, value, source."""
    rows = [("setting", "value", "source")]
    for name, item in effective(cfg, sources).items():
        rows.append((name, _text_value(name, item["value"], cfg), str(sources[name])))
    w0 = max(len(r[0]) for r in rows)
    w1 = min(40, max(len(r[1]) for r in rows))
    lines = [f"config file: {config_file or '(none)'}", ""]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ns = vars(parser(prog).parse_args(sys.argv[1:] if argv is None else argv))
    as_json = ns.pop("json")
    toml_path = ns.pop("config")
    try:
        cfg, sources = load_with_sources(toml_path, os.environ, ns)
        check_tokens(cfg)
        load_master_key(cfg.master_key_file, cfg.master_key)  # its file checked as start-up checks it
        check_data_dir(cfg.store.data_dir)
    except KVStoreError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2
    config_file = toml_path or os.environ.get("KVSTORE_CONFIG")
    if as_json:
        doc = {"config_file": config_file, "settings": effective(cfg, sources)}
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(render(cfg, sources, config_file))
    return 0

"""Every setting's meaning and default, read from the settings file the wheel ships.

``kvstore/kvstore.toml`` (``deploy/kvstore.toml`` links to it) documents each
setting as a comment block above a line ``# name = default`` (commented out at
its default), ``# e.g. name = example`` (unset by default, or machine-dependent)
or ``name = value`` (pinned). This module turns those blocks into the help of
``kvstore serve`` (and of ``kvstore config``, which takes the same flags), so
the flags' help and the file can never disagree.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from kvstore.server_config import SECRETS, SETTINGS

_SETTING = re.compile(r"^(?P<hash># )?(?P<eg>e\.g\. )?(?P<name>[a-z0-9_]+) = (?P<value>.+)$")


@dataclass(frozen=True, slots=True)
class SettingDoc:
    name: str
    text: str  # what the setting means (the comment block above it)
    default: str | None  # the default as TOML writes it; None: unset by default
    example: str | None  # an example value where the default is unset or depends on the machine


def settings_text() -> str:
    """The settings file shipped in the package."""
    return resources.files("kvstore").joinpath("kvstore.toml").read_text(encoding="utf-8")


def parse(text: str) -> dict[str, SettingDoc]:
    """Each setting of ``text`` with the comment block above it. Settings that
    follow each other share the block above the first."""
    docs: dict[str, SettingDoc] = {}
    block: list[str] = []
    last = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        m = _SETTING.match(line)
        if m:
            if block:
                last = " ".join(block)
            example = m["value"] if m["eg"] else None
            default = None if m["eg"] else m["value"]
            docs[m["name"]] = SettingDoc(m["name"], last, default, example)
            block = []
        elif line.startswith("#") and not set(line) <= set("#- "):
            block.append(line.lstrip("#").strip())
        else:
            block, last = [], ""
    return docs


@cache
def shipped() -> dict[str, SettingDoc]:
    return parse(settings_text())


def flag_help(name: str) -> str:
    """``--name``'s help: its meaning, default and variable (argparse's % escaped)."""
    doc = shipped().get(name)
    if doc is None:
        return f"(undocumented) [env KVSTORE_{name.upper()}]"
    if doc.default is not None:
        tail = f"default: {doc.default}"
    elif doc.example is not None:
        tail = f"unset by default; e.g. {doc.example}"
    else:
        tail = "unset by default"
    text = f"{doc.text} ({tail}; env KVSTORE_{name.upper()})"
    return text.replace("%", "%%")


def add_setting_flags(p: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per setting (secrets excepted: a flag shows
    in ``ps``), each with its help: what ``kvstore serve`` and ``kvstore
    config`` take. Each flag's dest is the setting's name; unset, None."""
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML settings file (default: $KVSTORE_CONFIG; neither: built-in defaults)",
    )
    for name in SETTINGS:
        if name in SECRETS:
            continue
        if name == "listen":  # several addresses: --listen 127.0.0.1:8420 --listen unix:/run/kvstore/kvstore.sock
            p.add_argument("--listen", dest=name, metavar="ADDRESS", action="append", help=flag_help(name))
        else:
            p.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE", help=flag_help(name))

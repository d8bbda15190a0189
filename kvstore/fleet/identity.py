"""A fleet node's identity: its id (kept in the data directory: the data
belongs to that node) and the URL clients and peers reach it at."""

from __future__ import annotations

import secrets
import socket
from dataclasses import replace
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.fsutil import atomic_write
from kvstore.names import NODE_ID
from kvstore.server_config import ServerConfig

NODE_ID_FILE = "node-id"


def resolve(cfg: ServerConfig) -> ServerConfig:
    """``cfg`` with the fleet node's ``node_id`` and ``advertise_url`` filled
    in (unchanged when ``fleet`` is off). The id: the setting, else the one
    kept in ``DATA/node-id``, else a new one kept there; a setting that
    differs from the kept id stops start-up (the data is that node's)."""
    s = cfg.store
    if not s.fleet:
        return cfg
    node_id = _kept_id(Path(s.data_dir), s.node_id)
    url = s.advertise_url or _default_url(cfg)
    return replace(cfg, store=replace(s, node_id=node_id, advertise_url=url))


def _kept_id(data_dir: Path, setting: str) -> str:
    path = data_dir / NODE_ID_FILE
    if path.exists():
        kept = path.read_text().strip()
        if NODE_ID.fullmatch(kept) is None:
            raise ConfigError(f"{str(path)!r} holds {kept!r}, which is not a node id")
        if setting and setting != kept:
            raise ConfigError(
                f"node_id={setting!r}: this data directory belongs to node {kept!r} ({str(path)!r}); "
                "a node's data cannot change its id"
            )
        return kept
    node_id = setting or f"n{secrets.token_hex(5)}"
    data_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, node_id.encode() + b"\n", mode=0o644)
    return node_id


def _default_url(cfg: ServerConfig) -> str:
    tcp = cfg.tcp_addresses
    if not tcp:
        raise ConfigError("advertise_url: needed for fleet = true when listen has no TCP address")
    host, port = tcp[0]
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if cfg.tls_cert else "http"
    return f"{scheme}://{host}:{port}"

"""kvstore daemon: argv -> config -> event loop -> app.

    kvstore serve --data-dir DIR --listen HOST:PORT [--config FILE]

(``python server.py`` in a checkout is the same.) The admin token comes from
KVSTORE_ADMIN_TOKEN (or admin_token_file; at least 32 characters), the master
key from KVSTORE_MASTER_KEY_FILE (a 0600 file of 32 random bytes) or
KVSTORE_MASTER_KEY. Every setting is also a TOML key and a KVSTORE_* variable,
listed with its meaning and default below and in kvstore.toml (shipped in the
package; deploy/kvstore.toml in a checkout). SIGTERM drains in-flight requests
and queued writes, then exits; under systemd (Type=notify) it reports READY,
STOPPING, WATCHDOG. SIGHUP reloads the TLS certificate and key. With
--workers N, N processes share the port; the default, "auto", is one per CPU,
bounded by memory.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvloop

from kvstore import __version__, redaction, workers
from kvstore.daemon.process import os_error, serve
from kvstore.daemon.supervisor import supervise
from kvstore.engine.api import load_master_key
from kvstore.errors import ConfigError, KVStoreError
from kvstore.fleet import identity as fleet_identity
from kvstore.server_config import AUTO, SECRETS, SETTINGS, check_tokens, load
from kvstore.settings_doc import flag_help
from kvstore.tuning import keep_freed_memory

log = logging.getLogger("kvstore.server")


def parse_args(argv: list[str], prog: str | None = None) -> tuple[str | None, dict[str, Any]]:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kvstore {__version__}")
    p.add_argument("--config", help="TOML configuration file (default: $KVSTORE_CONFIG; none: built-in defaults)")
    for name in SETTINGS:
        if name in SECRETS:
            continue  # secrets never on the command line (visible in ps)
        if name == "listen":  # several addresses: --listen 127.0.0.1:8420 --listen unix:/run/kvstore/kvstore.sock
            p.add_argument("--listen", dest=name, metavar="ADDRESS", action="append", help=flag_help(name))
        else:
            p.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE", help=flag_help(name))
    ns = vars(p.parse_args(argv))
    return ns.pop("config"), ns


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    try:
        toml_path, flags = parse_args(sys.argv[1:] if argv is None else argv, prog)
        cfg = load(toml_path, flags=flags)
        logging.basicConfig(
            level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
        )
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload during start-up is not a reason to die
        scrubber = redaction.install()  # before anything can log a secret; workers inherit it
        scrubber.add_secret(cfg.master_key)
        scrubber.add_secret(cfg.admin_secret())
        scrubber.add_secret(cfg.metrics_secret())
        check_tokens(cfg)
        keep_freed_memory()
        master = load_master_key(cfg.master_key_file, cfg.master_key)
        scrubber.add_key(master.secret)
        check_data_dir(cfg.store.data_dir)
        cfg = fleet_identity.resolve(cfg)  # a fleet node's id and URL, once, before any fork
        if cfg.workers == AUTO:  # resolved once, here, before any fork
            auto = workers.machine_workers(cfg)
            log.info("%s", auto)
            cfg = replace(cfg, workers=auto.count)
        if cfg.worker_count > 1:
            return supervise(cfg, master)
        uvloop.run(serve(cfg, master))
        return 0
    except KVStoreError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the host's doing (permissions, a full disk...): one line, as for a bad setting
        log.debug("start-up failed", exc_info=e)
        print(f"kvstore: {os_error(e)}", file=sys.stderr)
        return 2


def check_data_dir(path: Path) -> None:
    """``data_dir`` is a directory, or can be made one: neither it nor the
    nearest of its parents that exists is something else (a file)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "it" if existing == path else f"{str(existing)!r}"
        raise ConfigError(f"data_dir={str(path)!r}: {what} is not a directory")

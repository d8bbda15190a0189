"""``kvstore serve``: argv -> config -> event loop -> app.

(``python server.py`` in a checkout is the same.) The order of start-up is
main()'s: the settings (server_config.load), logging (kvstore/logs.py) with
the secret scrubber installed before anything can log a secret, the tokens'
and the master key's checks, the data directory's, the fleet identity and
the workers resolved once before any fork; then one process (process.py) or
the supervisor. What an operator reads is the parser's description and
epilog (:data:`DESCRIPTION`, :data:`EPILOG`), not this docstring.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import replace
from typing import Any

import uvloop

from kvstore import __version__, logs, redaction, workers
from kvstore.daemon.process import os_error, serve
from kvstore.daemon.supervisor import supervise
from kvstore.engine.api import load_master_key
from kvstore.errors import KVStoreError
from kvstore.fleet import identity as fleet_identity
from kvstore.server_config import AUTO, check_data_dir, check_tokens, load
from kvstore.settings_doc import add_setting_flags
from kvstore.tuning import keep_freed_memory

log = logging.getLogger("kvstore.server")


DESCRIPTION = """\
Run the kvstore daemon, serving KV-cache blocks to inference engines.

It serves them over HTTP (and, where configured, unix sockets, the
S3-compatible gateway and NIXL) from the data directory, and from the object
tier behind it.

Every setting is a flag below, a key of the TOML file (--config, or
$KVSTORE_CONFIG) and a KVSTORE_<NAME> variable; flags win over variables,
variables over the file, the file over the defaults. 'kvstore config' shows
the settings a start would use and where each came from."""

EPILOG = """\
secrets (never flags: a flag shows in ps):
  the admin token     KVSTORE_ADMIN_TOKEN, or admin_token_file (32 characters
                      or more; python3 -c 'import secrets;
                      print(secrets.token_urlsafe(32))' makes one)
  the master key      KVSTORE_MASTER_KEY_FILE (a 0600 file of 32 random bytes),
                      or KVSTORE_MASTER_KEY

signals:
  SIGTERM             drain in-flight requests and queued writes, then exit
                      (up to shutdown_timeout_s)
  SIGHUP              reload the TLS certificate and key
  Under systemd (Type=notify) it reports READY, STOPPING and WATCHDOG.

exit status:
  0                   stopped cleanly
  2                   could not start: a bad setting, a missing or wrong master
                      key, a data directory it cannot use, an address it cannot
                      listen on; one line on stderr says which
  other               a worker or the store failed while serving (see the log)

With --workers N, N processes share the port; the default, auto, is one per
CPU, bounded by memory. Files: the settings with their defaults are in
kvstore.toml (in the package; /etc/kvstore/kvstore.toml in the image)."""


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """``kvstore serve``'s flags: ``--version``, ``--config`` and a flag per setting."""
    p = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [-h] [--version] [--config FILE] [--SETTING VALUE ...]",  # not the ~90 flags
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"kvstore {__version__}")
    add_setting_flags(p)
    return p


def parse_args(argv: list[str], prog: str | None = None) -> tuple[str | None, dict[str, Any]]:
    ns = vars(parser(prog).parse_args(argv))
    return ns.pop("config"), ns


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    try:
        toml_path, flags = parse_args(sys.argv[1:] if argv is None else argv, prog)
        cfg = load(toml_path, flags=flags)
        logs.setup(cfg.log_level, cfg.log_format)
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

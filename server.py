"""kvstore daemon: argv -> config -> event loop -> app.

    .venv/bin/python server.py --data-dir DIR --listen HOST:PORT [--config FILE]

The admin token comes from KVSTORE_ADMIN_TOKEN (or admin_token_file), the
master key from KVSTORE_MASTER_KEY_FILE (a 0600 file of 32 random bytes) or
KVSTORE_MASTER_KEY. Every setting is also a TOML key and a KVSTORE_* variable
(see deploy/kvstore.toml). SIGTERM drains in-flight requests and queued writes,
then exits; under systemd (Type=notify) it reports READY, STOPPING, WATCHDOG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import ssl
import sys
from typing import Any

import uvloop
from aiohttp import web

from kvstore import sdnotify
from kvstore.crypto import MasterKey, load_master_key
from kvstore.errors import ConfigError, KVStoreError
from kvstore.server_config import SETTINGS, ServerConfig, load
from kvstore.transport.http import make_app
from kvstore.transport.http_common import STATE
from kvstore.tuning import keep_freed_memory

log = logging.getLogger("kvstore.server")


def parse_args(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML configuration file (also KVSTORE_CONFIG)")
    for name in SETTINGS:
        if name in ("admin_token", "master_key"):
            continue  # secrets never on the command line (visible in ps)
        p.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE")
    ns = vars(p.parse_args(argv))
    return ns.pop("config"), ns


def tls_context(cfg: ServerConfig) -> ssl.SSLContext | None:
    if not cfg.tls_cert or not cfg.tls_key:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"tls_cert={cfg.tls_cert!r}, tls_key={cfg.tls_key!r}: {e}") from None
    return ctx


async def serve(cfg: ServerConfig, master: MasterKey) -> None:
    if cfg.workers != 1:
        raise ConfigError(f"workers={cfg.workers}: only 1 worker process is supported so far")
    if cfg.admin_secret() is None:
        log.warning("no admin token configured (KVSTORE_ADMIN_TOKEN): the admin API refuses every request")
    app = make_app(cfg, master)
    runner = web.AppRunner(
        app,
        keepalive_timeout=cfg.keepalive_timeout_s,
        shutdown_timeout=cfg.shutdown_timeout_s,
        access_log=None,
    )
    await runner.setup()  # opens the store: recovery runs before the port opens
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port, ssl_context=tls_context(cfg), backlog=1024)
        await site.start()
        scheme = "https" if cfg.tls_cert else "http"
        log.info("kvstore serving on %s://%s", scheme, cfg.listen)
        print(f"kvstore serving on {scheme}://{cfg.listen}", flush=True)
        sdnotify.notify("READY=1", f"STATUS=serving on {cfg.listen}")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watchdog = None
        interval = sdnotify.watchdog_interval()
        if interval is not None:
            watchdog = asyncio.create_task(sdnotify.watchdog_loop(interval, lambda: bool(app[STATE]["ready"])))
        await stop.wait()
        log.info("stopping: draining in-flight requests and queued writes")
        sdnotify.notify("STOPPING=1")
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
    finally:
        await runner.cleanup()  # stop accepting, finish requests, then close the store
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        toml_path, flags = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load(toml_path, flags=flags)
        logging.basicConfig(
            level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
        )
        keep_freed_memory()
        master = load_master_key(cfg.master_key_file, cfg.master_key)
        uvloop.run(serve(cfg, master))
        return 0
    except KVStoreError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

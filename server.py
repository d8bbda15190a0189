"""kvstore daemon: argv -> config -> event loop -> app.

    .venv/bin/python server.py --data-dir DIR --listen HOST:PORT [--config FILE]

The admin token comes from KVSTORE_ADMIN_TOKEN (or admin_token_file), the
master key from KVSTORE_MASTER_KEY_FILE (a 0600 file of 32 random bytes) or
KVSTORE_MASTER_KEY. Every setting is also a TOML key and a KVSTORE_* variable
(see deploy/kvstore.toml). SIGTERM drains in-flight requests and queued writes,
then exits; under systemd (Type=notify) it reports READY, STOPPING, WATCHDOG.
With --workers N, N processes share the port (see :func:`supervise`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import ssl
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import uvloop
from aiohttp import web

from kvstore import redaction, sdnotify
from kvstore.engine.crypto import MasterKey, load_master_key
from kvstore.errors import ConfigError, KVStoreError
from kvstore.server_config import SETTINGS, UNIX, ServerConfig, load
from kvstore.tasks import Background
from kvstore.transport.http import make_app
from kvstore.transport.http_common import METRICS, STATE, STORE
from kvstore.transport.http_server import KVAppRunner
from kvstore.transport.s3.gateway import make_gateway_app
from kvstore.transport.unix import UnixListener, bind_unix
from kvstore.tuning import die_with_parent, keep_freed_memory

log = logging.getLogger("kvstore.server")


def parse_args(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML configuration file (also KVSTORE_CONFIG)")
    for name in SETTINGS:
        if name in ("admin_token", "master_key"):
            continue  # secrets never on the command line (visible in ps)
        if name == "listen":  # several addresses: --listen 127.0.0.1:8420 --listen unix:/run/kvstore/kvstore.sock
            p.add_argument("--listen", dest=name, metavar="ADDRESS", action="append")
        else:
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


async def serve(
    cfg: ServerConfig,
    master: MasterKey,
    role: str = "single",
    writer_socket: str | None = None,
    on_ready: Callable[[], None] | None = None,
    unix_socks: list[UnixListener] | None = None,
) -> None:
    """Run one server process until SIGTERM/SIGINT. ``role`` as in make_app.
    ``unix_socks``: the listening unix sockets, bound by the supervisor and
    shared by its workers (None: bound, and removed at exit, here)."""
    if cfg.admin_secret() is None and role != "reader":
        log.warning("no admin token configured (KVSTORE_ADMIN_TOKEN): the admin API refuses every request")
    app = make_app(cfg, master, role, writer_socket)
    runner = KVAppRunner(
        app,
        keepalive_timeout=cfg.keepalive_timeout_s,
        shutdown_timeout=cfg.shutdown_timeout_s,
        access_log=None,
    )
    await runner.setup()  # opens the store: recovery runs before the port opens
    own_socks: list[UnixListener] = []
    gw_runner: KVAppRunner | None = None
    try:
        if role == "writer" and writer_socket:
            await web.UnixSite(runner, writer_socket).start()
        for host, port in cfg.tcp_addresses:
            site = web.TCPSite(
                runner, host, port, ssl_context=tls_context(cfg), backlog=1024, reuse_port=cfg.workers > 1
            )
            await site.start()
        if unix_socks is None:
            own_socks = unix_sockets(cfg)
        for listener in unix_socks if unix_socks is not None else own_socks:
            await web.SockSite(runner, listener.sock).start()
        gateway = cfg.s3_gateway_address if role != "reader" else None
        if gateway is not None:  # the writer's: objects are written where the store's writes are owned
            gw_runner = KVAppRunner(
                make_gateway_app(app[STORE], app[METRICS], cfg),
                keepalive_timeout=cfg.keepalive_timeout_s,
                shutdown_timeout=cfg.shutdown_timeout_s,
                access_log=None,
            )
            await gw_runner.setup()
            await web.TCPSite(gw_runner, gateway[0], gateway[1], ssl_context=tls_context(cfg), backlog=1024).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        where = serving_on(cfg)
        log.info("%s serving on %s", role, where)
        if on_ready is not None:
            on_ready()
        else:
            print(f"kvstore serving on {where}", flush=True)
            sdnotify.notify("READY=1", f"STATUS=serving on {where}")
        watchdog = Background()
        interval = sdnotify.watchdog_interval() if on_ready is None else None
        if interval is not None:
            watchdog.spawn(sdnotify.watchdog_loop(interval, lambda: bool(app[STATE]["ready"])), "watchdog")
        await stop.wait()
        log.info("%s stopping: draining in-flight requests and queued writes", role)
        if on_ready is None:
            sdnotify.notify("STOPPING=1")
        await watchdog.close()
    finally:
        if gw_runner is not None:
            await gw_runner.cleanup()  # before the store closes under it
        await runner.cleanup()  # stop accepting, finish requests, then close the store
        for listener in own_socks:
            listener.remove()
    log.info("%s stopped", role)


def unix_sockets(cfg: ServerConfig) -> list[UnixListener]:
    """Bind every ``unix:PATH`` of ``listen``."""
    socks: list[UnixListener] = []
    try:
        for path in cfg.unix_paths:
            socks.append(bind_unix(path, cfg.unix_socket_mode, cfg.unix_socket_group))
    except ConfigError:
        for listener in socks:
            listener.remove()
        raise
    return socks


def serving_on(cfg: ServerConfig) -> str:
    """Where the daemon answers, as clients name it: http(s)://HOST:PORT, unix:PATH."""
    scheme = "https" if cfg.tls_cert else "http"
    tcp = [f"{scheme}://{a}" for a in cfg.listen.split(",") if not a.startswith(UNIX)]
    gateway = [f"S3 gateway {scheme}://{cfg.s3_gateway_listen}"] if cfg.s3_gateway_listen else []
    return ", ".join(tcp + [UNIX + p for p in cfg.unix_paths] + gateway)


def _worker(
    cfg: ServerConfig,
    secret: bytes,
    role: str,
    sock: str,
    ready: Connection,
    supervisor: int,
    unix_socks: list[UnixListener],
) -> None:
    """A worker process of a multi-worker daemon (forked by :func:`supervise`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops workers in order
    die_with_parent(signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before prctl took effect
        sys.exit(1)

    def on_ready() -> None:
        # SIGTERM from a supervisor that died while this worker was opening the
        # store can be lost before the loop's handler is installed: look again.
        if os.getppid() != supervisor:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        ready.send("ready")

    try:
        uvloop.run(serve(cfg, MasterKey(secret), role, sock, on_ready, unix_socks))
    except KVStoreError as e:
        print(f"kvstore {role}: {e}", file=sys.stderr)
        sys.exit(2)


def supervise(cfg: ServerConfig, master: MasterKey) -> int:
    """Run ``cfg.workers`` processes sharing the port (SO_REUSEPORT): one writer
    that owns the store's writes, and readers that serve reads from the same
    files and forward writes to the writer over a unix socket. Readers stop
    before the writer, so forwarded writes in flight still land; if any worker
    dies, the rest are stopped and the daemon exits (systemd restarts it)."""
    ctx = multiprocessing.get_context("fork")  # before any thread or event loop exists here
    unix_socks = unix_sockets(cfg)  # one listening socket per path, shared by every worker
    sock_dir = tempfile.mkdtemp(prefix="kvstore-")  # mode 0700: only this user reaches the writer
    sock = os.path.join(sock_dir, "writer.sock")
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    procs: list[tuple[str, BaseProcess]] = []

    def start(role: str) -> bool:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker,
            args=(cfg, master.secret, role, sock, child, os.getpid(), unix_socks),
            name=f"kvstore-{role}",
        )
        p.start()
        child.close()
        procs.append((role, p))
        while not stopping:
            try:
                if parent.poll(0.2):
                    return bool(parent.recv() == "ready")
            except (EOFError, OSError):  # it died before saying so (a start-up error, already printed)
                return False
            if not p.is_alive():
                return False
        return False

    rc = 0
    try:
        ok = start("writer") and all(start("reader") for _ in range(cfg.workers - 1))
        if not ok:
            rc = 0 if stopping else 1
        else:
            where = serving_on(cfg)
            print(f"kvstore serving on {where} with {cfg.workers} workers", flush=True)
            sdnotify.notify("READY=1", f"STATUS=serving on {where} with {cfg.workers} workers")
            interval = sdnotify.watchdog_interval()
            while not stopping:
                wait([p.sentinel for _, p in procs], timeout=min(interval or 1.0, 1.0))
                dead = [f"{role} (pid {p.pid}, exit {p.exitcode})" for role, p in procs if not p.is_alive()]
                if dead:
                    log.error("worker died: %s; stopping the others", ", ".join(dead))
                    rc = 1
                    break
                if interval is not None:
                    sdnotify.notify("WATCHDOG=1")
            sdnotify.notify("STOPPING=1")
    finally:
        for role in ("reader", "writer"):  # readers first: they forward writes to the writer
            group = [p for r, p in procs if r == role]
            for p in group:
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, signal.SIGTERM)
            for p in group:
                p.join(cfg.shutdown_timeout_s + 10)
                if p.is_alive():
                    p.kill()
                    p.join()
        shutil.rmtree(sock_dir, ignore_errors=True)
        for listener in unix_socks:
            listener.remove()
    log.info("stopped")
    return rc


def main(argv: list[str] | None = None) -> int:
    try:
        toml_path, flags = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load(toml_path, flags=flags)
        logging.basicConfig(
            level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
        )
        scrubber = redaction.install()  # before anything can log a secret; workers inherit it
        scrubber.add_secret(cfg.master_key)
        scrubber.add_secret(cfg.admin_secret())
        keep_freed_memory()
        master = load_master_key(cfg.master_key_file, cfg.master_key)
        scrubber.add_key(master.secret)
        if cfg.workers > 1:
            return supervise(cfg, master)
        uvloop.run(serve(cfg, master))
        return 0
    except KVStoreError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

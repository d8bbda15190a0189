"""One process of the daemon (the only one, or a worker): its node and its
listeners, served until SIGTERM; SIGHUP reloads the TLS certificate."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
from collections.abc import Callable

from aiohttp import web

from kvstore import sdnotify
from kvstore.daemon.app import NODE, make_app
from kvstore.daemon.listeners import bind_tcp, close_listeners, listeners, serving_on
from kvstore.daemon.node import Shared
from kvstore.daemon.tls import load_pair, server_context
from kvstore.engine.api import MasterKey
from kvstore.errors import ConfigError
from kvstore.server_config import ServerConfig
from kvstore.tasks import Background
from kvstore.transport.http.connection import KVAppRunner
from kvstore.transport.http.unix import BACKLOG, UnixListener
from kvstore.transport.s3.gateway import make_gateway_app

log = logging.getLogger("kvstore.server")


def tls_context(cfg: ServerConfig) -> ssl.SSLContext | None:
    if not cfg.tls_cert or not cfg.tls_key:
        return None
    return server_context(cfg.tls_cert, cfg.tls_key)


async def serve(
    cfg: ServerConfig,
    master: MasterKey,
    role: str = "single",
    writer_socket: str | None = None,
    on_ready: Callable[[], None] | None = None,
    bound: tuple[list[socket.socket], list[UnixListener]] | None = None,
    shared: Shared | None = None,
) -> None:
    """Run one server process until SIGTERM/SIGINT. ``role`` and
    ``shared`` as in make_app. ``bound``: the listening sockets
    (:func:`listeners`), bound by the supervisor and shared by its workers
    (None: bound, and closed or removed at exit, here).

    Every address is bound before the store opens (a port in use, a bad TLS
    key stop start-up with one line before recovery runs) and listens only
    once it is open."""
    if cfg.admin_secret() is None and role != "reader":
        log.warning("no admin token configured (KVSTORE_ADMIN_TOKEN): the admin API refuses every request")
    tls = tls_context(cfg)
    gateway = cfg.s3_gateway_address if role != "reader" else None  # the writer's: see below
    tcp, unix = listeners(cfg) if bound is None else bound
    try:
        gw_tcp = bind_tcp("s3_gateway_listen", *gateway) if gateway is not None else []
        await _serve_on(cfg, master, role, writer_socket, on_ready, tls, tcp, gw_tcp, unix, shared)
    finally:
        if bound is None:  # this process's own: the supervisor closes what it bound
            close_listeners(tcp, unix)
    log.info("%s stopped", role)


async def _serve_on(
    cfg: ServerConfig,
    master: MasterKey,
    role: str,
    writer_socket: str | None,
    on_ready: Callable[[], None] | None,
    tls: ssl.SSLContext | None,
    tcp: list[socket.socket],
    gw_tcp: list[socket.socket],
    unix_socks: list[UnixListener],
    shared: Shared | None,
) -> None:
    """:func:`serve` once every address is bound."""
    app = make_app(cfg, master, role, writer_socket, shared)
    runner = KVAppRunner(
        app,
        keepalive_timeout=cfg.keepalive_timeout_s,
        shutdown_timeout=cfg.shutdown_timeout_s,
        access_log=None,
    )
    await runner.setup()  # opens the node: recovery runs before the port listens
    node = app[NODE]
    gw_runner: KVAppRunner | None = None
    try:
        if role == "writer" and writer_socket:
            # Every reader may open up to max_concurrency + 1 relay connections
            # at once; a full accept queue refuses the next one at once (EAGAIN).
            queue = (cfg.worker_count - 1) * (cfg.max_concurrency + 1) + 64
            await web.UnixSite(runner, writer_socket, backlog=queue).start()
        for sock in tcp:
            await web.SockSite(runner, sock, ssl_context=tls, backlog=BACKLOG).start()
        for listener in unix_socks:
            await web.SockSite(runner, listener.sock, backlog=BACKLOG).start()
        if gw_tcp:  # the writer's: objects are written where the store's writes are owned
            gw_runner = KVAppRunner(
                make_gateway_app(
                    node.store,
                    node.store.metrics,
                    cfg,
                    node.admission,
                    node.fleet.confirm_registry if node.fleet is not None else None,
                ),
                gate_expect=False,  # the gateway answers Expect itself, after SigV4
                keepalive_timeout=cfg.keepalive_timeout_s,
                shutdown_timeout=cfg.shutdown_timeout_s,
                access_log=None,
            )
            await gw_runner.setup()
            for sock in gw_tcp:
                await web.SockSite(gw_runner, sock, ssl_context=tls, backlog=BACKLOG).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload, cfg, tls, role)
        where = serving_on(cfg, gateway=bool(gw_tcp))
        log.info("%s serving on %s", role, where)
        if on_ready is not None:
            on_ready()
        else:
            print(f"kvstore serving on {where}", flush=True)
            sdnotify.notify("READY=1", f"STATUS=serving on {where}")
        watchdog = Background()
        interval = sdnotify.watchdog_interval() if on_ready is None else None
        if interval is not None:
            watchdog.spawn(sdnotify.watchdog_loop(interval, lambda: node.admission.ready), "watchdog")
        await stop.wait()
        log.info("%s stopping: draining in-flight requests and queued writes", role)
        if on_ready is None:
            sdnotify.notify("STOPPING=1")
        await watchdog.close()
    finally:
        if gw_runner is not None:
            await gw_runner.cleanup()  # before the store closes under it
        await runner.cleanup()  # stop accepting, finish requests, then close the store


def reload(cfg: ServerConfig, tls: ssl.SSLContext | None, role: str) -> None:
    """SIGHUP: take in what can change without a restart, and say what.

    The TLS certificate and key are read again from ``tls_cert`` and
    ``tls_key`` into the context every listener uses: connections made from
    now on present the new ones, open ones keep theirs. Files that do not
    load leave the old certificate in place (logged as an error). The admin
    and metrics token files are read at each use already; the log goes to
    stderr (the journal, the container's log), so there is no file to reopen."""
    if tls is None or not cfg.tls_cert or not cfg.tls_key:
        log.info("%s: SIGHUP: nothing to reload (no TLS; the log goes to stderr)", role)
        return
    try:
        load_pair(tls, cfg.tls_cert, cfg.tls_key)
    except ConfigError as e:
        log.error("%s: SIGHUP: TLS certificate not reloaded, the old one stays in use: %s", role, e)
        return
    log.info("%s: SIGHUP: TLS certificate and key reloaded from %s and %s", role, cfg.tls_cert, cfg.tls_key)


def os_error(e: OSError) -> str:
    """An OSError as one line: what failed, on which path."""
    where = f": {e.filename!r}" if e.filename is not None else ""
    return f"start-up failed: {e.strerror or type(e).__name__}{where}"

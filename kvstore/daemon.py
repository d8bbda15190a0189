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
import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import ssl
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from kvstore import __version__, redaction, sdnotify, workers
from kvstore.engine.api import MasterKey, load_master_key
from kvstore.errors import ConfigError, KVStoreError
from kvstore.fleet import identity as fleet_identity
from kvstore.qos.buckets import shared_table
from kvstore.server_config import AUTO, SECRETS, SETTINGS, UNIX, ServerConfig, check_tokens, load
from kvstore.settings_doc import flag_help
from kvstore.tasks import Background
from kvstore.transport.http.app import make_app
from kvstore.transport.http.appkeys import METRICS, STATE, STORE
from kvstore.transport.http.connection import KVAppRunner
from kvstore.transport.http.qos import QOS
from kvstore.transport.http.unix import BACKLOG, UnixListener, bind_unix
from kvstore.transport.s3.gateway import make_gateway_app
from kvstore.tuning import die_with_parent, keep_freed_memory

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
    bound: tuple[list[socket.socket], list[UnixListener]] | None = None,
    qos_table: int | None = None,
) -> None:
    """Run one server process until SIGTERM/SIGINT. ``role`` and
    ``qos_table`` as in make_app. ``bound``: the listening sockets
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
        await _serve_on(cfg, master, role, writer_socket, on_ready, tls, tcp, gw_tcp, unix, qos_table)
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
    qos_table: int | None,
) -> None:
    """:func:`serve` once every address is bound."""
    app = make_app(cfg, master, role, writer_socket, qos_table)
    runner = KVAppRunner(
        app,
        keepalive_timeout=cfg.keepalive_timeout_s,
        shutdown_timeout=cfg.shutdown_timeout_s,
        access_log=None,
    )
    await runner.setup()  # opens the store: recovery runs before the port listens
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
                make_gateway_app(app[STORE], app[METRICS], cfg, app[QOS]),
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


def listeners(cfg: ServerConfig) -> tuple[list[socket.socket], list[UnixListener]]:
    """Bind every address of ``listen`` (TCP, then ``unix:``): once per
    daemon, by the process that forks the workers, which inherit the very
    same sockets; all let go again if one cannot be bound. No SO_REUSEPORT:
    with it any process of the same user could bind the port too and take a
    share of the connections (a second daemon on another data directory
    did); without it, the second daemon's bind fails and it stops."""
    tcp: list[socket.socket] = []
    unix: list[UnixListener] = []
    try:
        for host, port in cfg.tcp_addresses:
            tcp += bind_tcp("listen", host, port)
        for path in cfg.unix_paths:
            unix.append(bind_unix(path, cfg.unix_socket_mode, cfg.unix_socket_group))
    except ConfigError:
        close_listeners(tcp, unix)
        raise
    return tcp, unix


def close_listeners(tcp: list[socket.socket], unix: list[UnixListener]) -> None:
    for sock in tcp:
        sock.close()
    for listener in unix:
        listener.remove()


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
        tls.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (OSError, ssl.SSLError) as e:
        log.error("%s: SIGHUP: TLS certificate not reloaded, the old one stays in use: %s", role, e)
        return
    log.info("%s: SIGHUP: TLS certificate and key reloaded from %s and %s", role, cfg.tls_cert, cfg.tls_key)


def bind_tcp(setting: str, host: str, port: int) -> list[socket.socket]:
    """Sockets bound, not yet listening, to every address ``host`` names
    (as asyncio's create_server binds them), for this daemon alone. A
    connection is refused until the store is open and they listen; a port in
    use is a ConfigError naming the address."""
    where = f"{setting}={host}:{port}" if ":" not in host else f"{setting}=[{host}]:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"{where}: the host cannot be resolved ({e.strerror})") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only, never a live listener
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.setblocking(False)
    except OSError as e:
        for sock in socks:
            sock.close()
        raise ConfigError(f"{where}: cannot listen there: {e.strerror or e}") from None
    return socks


def serving_on(cfg: ServerConfig, gateway: bool = True) -> str:
    """Where the daemon answers, as clients name it: http(s)://HOST:PORT,
    unix:PATH, and the S3 gateway (``gateway``: only the process that binds
    it says so, the writer of several workers)."""
    scheme = "https" if cfg.tls_cert else "http"
    tcp = [f"{scheme}://{a}" for a in cfg.listen.split(",") if not a.startswith(UNIX)]
    gateway_at = [f"S3 gateway {scheme}://{cfg.s3_gateway_listen}"] if gateway and cfg.s3_gateway_listen else []
    return ", ".join(tcp + [UNIX + p for p in cfg.unix_paths] + gateway_at)


def _worker(
    cfg: ServerConfig,
    secret: bytes,
    role: str,
    sock: str,
    ready: Connection,
    supervisor: int,
    bound: tuple[list[socket.socket], list[UnixListener]],
    qos_table: int,
) -> None:
    """A worker process of a multi-worker daemon (forked by :func:`supervise`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops workers in order
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve() handles it: a reload never kills
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
        uvloop.run(serve(cfg, MasterKey(secret), role, sock, on_ready, bound, qos_table))
    except KVStoreError as e:
        print(f"kvstore {role}: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        log.debug("%s: start-up failed", role, exc_info=e)
        print(f"kvstore {role}: {os_error(e)}", file=sys.stderr)
        sys.exit(2)


def supervise(cfg: ServerConfig, master: MasterKey) -> int:
    """Run ``cfg.worker_count`` processes sharing the listening sockets (bound
    here, inherited by each): one writer that owns the store's writes, and
    readers that serve reads from the same files and forward writes to the
    writer over a unix socket. Readers stop before the writer, so forwarded
    writes in flight still land; if any worker dies, the rest are stopped and
    the daemon exits (systemd restarts it)."""
    ctx = multiprocessing.get_context("fork")  # before any thread or event loop exists here
    # One listening socket per address, shared by every worker and by no other process.
    qos_table = shared_table()  # the tenants' token buckets, in memory every worker maps
    bound = listeners(cfg)
    sock_dir = tempfile.mkdtemp(prefix="kvstore-")  # mode 0700: only this user reaches the writer
    sock = os.path.join(sock_dir, "writer.sock")
    stopping = hangup = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def on_hangup(signum: int, frame: object) -> None:
        nonlocal hangup
        hangup = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    procs: list[tuple[str, BaseProcess]] = []

    def start(role: str) -> bool:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker,
            args=(cfg, master.secret, role, sock, child, os.getpid(), bound, qos_table),
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
        ok = start("writer") and all(start("reader") for _ in range(cfg.worker_count - 1))
        if not ok:
            rc = 0 if stopping else 1
        else:
            where = serving_on(cfg)
            print(f"kvstore serving on {where} with {cfg.worker_count} workers", flush=True)
            sdnotify.notify("READY=1", f"STATUS=serving on {where} with {cfg.worker_count} workers")
            interval = sdnotify.watchdog_interval()
            while not stopping:
                wait([p.sentinel for _, p in procs], timeout=min(interval or 1.0, 1.0))
                dead = [f"{role} (pid {p.pid}, exit {p.exitcode})" for role, p in procs if not p.is_alive()]
                if dead:
                    log.error("worker died: %s; stopping the others", ", ".join(dead))
                    rc = 1
                    break
                if hangup:  # each worker reloads what it serves with
                    hangup = False
                    log.info("SIGHUP: passed on to %d workers", len(procs))
                    for _, p in procs:
                        if p.pid is not None:
                            os.kill(p.pid, signal.SIGHUP)
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
        close_listeners(*bound)
        os.close(qos_table)
    log.info("stopped")
    return rc


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
        if cfg.store.fleet:
            if cfg.workers not in (AUTO, 1):
                raise ConfigError(f"workers={cfg.workers!r}: a fleet node (fleet = true) runs one worker for now")
            cfg = replace(cfg, workers=1)
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


def os_error(e: OSError) -> str:
    """An OSError as one line: what failed, on which path."""
    where = f": {e.filename!r}" if e.filename is not None else ""
    return f"start-up failed: {e.strerror or type(e).__name__}{where}"


def check_data_dir(path: Path) -> None:
    """``data_dir`` is a directory, or can be made one: neither it nor the
    nearest of its parents that exists is something else (a file)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "it" if existing == path else f"{str(existing)!r}"
        raise ConfigError(f"data_dir={str(path)!r}: {what} is not a directory")

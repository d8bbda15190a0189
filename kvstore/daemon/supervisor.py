"""The supervisor of a multi-worker daemon: one writer that owns the
store's writes and readers that serve reads, sharing the listening sockets
(bound here, inherited by each) and the tenants' QoS buckets."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import uvloop

from kvstore import sdnotify, touchbells
from kvstore.daemon.listeners import close_listeners, foreign_listeners, serving_on, worker_listeners
from kvstore.daemon.node import Shared
from kvstore.daemon.process import os_error, serve
from kvstore.engine.api import MasterKey
from kvstore.errors import KVStoreError
from kvstore.fleet.shared import shared_state
from kvstore.qos.buckets import shared_table
from kvstore.server_config import ServerConfig
from kvstore.transport.http.unix import UnixListener
from kvstore.tuning import die_with_parent

log = logging.getLogger("kvstore.server")


def _worker(
    cfg: ServerConfig,
    secret: bytes,
    role: str,
    sock: str,
    ready: Connection,
    supervisor: int,
    bound: tuple[list[socket.socket], list[UnixListener]],
    shared: Shared,
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
        uvloop.run(serve(cfg, MasterKey(secret), role, sock, on_ready, bound, shared))
    except KVStoreError as e:
        print(f"kvstore {role}: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        log.debug("%s: start-up failed", role, exc_info=e)
        print(f"kvstore {role}: {os_error(e)}", file=sys.stderr)
        sys.exit(2)


def supervise(cfg: ServerConfig, master: MasterKey) -> int:
    """Run ``cfg.worker_count`` processes, each listening on its own socket
    per TCP address and sharing the unix sockets (bound here, inherited):
    one writer that owns the store's writes, and
    readers that serve reads from the same files and forward writes to the
    writer over a unix socket. Readers stop before the writer, so forwarded
    writes in flight still land; if any worker dies, the rest are stopped and
    the daemon exits (systemd restarts it)."""
    ctx = multiprocessing.get_context("fork")  # before any thread or event loop exists here
    # Each worker's own listening socket per TCP address (SO_REUSEPORT: the kernel
    # spreads connections over them), held by no other process; unix sockets shared.
    # The tenants' token buckets, and a fleet node's state, in memory every worker maps.
    shared = Shared(shared_table(), shared_state() if cfg.store.fleet else None, touchbells.bells(cfg.worker_count - 1))
    per_worker, unix = worker_listeners(cfg, cfg.worker_count)
    all_tcp = [s for own in per_worker for s in own]
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
        bound = (per_worker[len(procs)], unix)
        own = replace(shared, bell=len(procs) - 1) if role == "reader" else shared  # reader i rings at bells[i]
        p = ctx.Process(
            target=_worker,
            args=(cfg, master.secret, role, sock, child, os.getpid(), bound, own),
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
            # A worker that could not start said why on one line and exited 2
            # (a setting, a missing bucket, the host's doing): so does the daemon.
            last = procs[-1][1]  # the one that did not start
            last.join(10)
            rc = 0 if stopping else 2 if last.exitcode == 2 else 1
        elif others := foreign_listeners(all_tcp):
            # Another process bound the port with SO_REUSEPORT while this one
            # started (a second daemon whose start overlapped): it would take
            # a share of the connections. Stop, as a port in use stops us.
            print(
                f"kvstore: listen={','.join(others)}: another process is listening there too; "
                "two daemons may not share a port",
                file=sys.stderr,
                flush=True,
            )
            rc = 2
        else:
            where = serving_on(cfg)
            print(f"kvstore serving on {where} with {cfg.worker_count} workers", flush=True)
            sdnotify.notify("READY=1", f"STATUS=serving on {where} with {cfg.worker_count} workers")
            interval = sdnotify.watchdog_interval()
            while not stopping:
                wait([p.sentinel for _, p in procs], timeout=min(interval or 1.0, 1.0))
                ended = [(role, p) for role, p in procs if not p.is_alive()]
                if ended:
                    rc = _ended(ended, lambda: stopping)
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
        close_listeners(all_tcp, unix)
        for fd in (shared.qos, shared.fleet):
            if fd is not None:
                os.close(fd)
        touchbells.close(shared.bells)
    log.info("stopped")
    return rc


SIGNAL_GRACE_S = 0.2  # how long a SIGTERM sent to the whole group may take to reach the supervisor's handler


def _ended(ended: list[tuple[str, BaseProcess]], stopping: Callable[[], bool]) -> int:
    """The daemon's exit status once the workers in ``ended`` are gone.

    A worker exits 0 only once it has drained after SIGTERM (or SIGINT):
    someone stopped it. Under systemd's ``KillMode=control-group``, or
    ``kill -TERM -- -PGID``, every process of the group gets the signal at
    once, and a worker can be gone before the supervisor's own handler has
    run: that is a stop, exit 0, not a death. Any other end (an exit
    status, a signal that killed it) is a failure: exit 1, and the service
    manager restarts the daemon."""
    what = ", ".join(f"{role} (pid {p.pid}, exit {p.exitcode})" for role, p in ended)
    if any(p.exitcode != 0 for _, p in ended):
        log.error("worker died: %s; stopping the others", what)
        return 1
    deadline = time.monotonic() + SIGNAL_GRACE_S
    while not stopping() and time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs between these sleeps, if the signal was the group's
    if stopping():
        log.info("stopping: %s already stopped on the same signal", what)
    else:
        log.warning("%s stopped on a signal of its own (not the supervisor's): stopping the others", what)
    return 0

"""The daemon's listening sockets: bound once, before the store opens (a
port in use stops start-up with one line), by the process that forks the
workers.

With several workers each TCP address is bound once per worker with
SO_REUSEPORT, each worker listening on its own: the kernel spreads new
connections over the workers by their addresses, whatever a client's
pooling (one shared socket let whichever worker woke first accept a whole
burst: a pool of connections all on the writer, the readers idle). Only
this daemon may hold the port: each address is first bound once without
SO_REUSEPORT (a port any process listens on stops start-up, as before),
and once the workers listen, :func:`foreign_listeners` finds any other
process that joined the port meanwhile (its start-up overlapping ours):
then the daemon stops rather than share its connections. Unix sockets are
bound once and shared (the kernel has no SO_REUSEPORT for them)."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.server_config import UNIX, ServerConfig
from kvstore.transport.http.unix import UnixListener, bind_unix


def listeners(cfg: ServerConfig) -> tuple[list[socket.socket], list[UnixListener]]:
    """Bind every address of ``listen`` (TCP, then ``unix:``): once per
    daemon, by the process that forks the workers, which inherit the very
    same sockets (one process: see :func:`worker_listeners` for several);
    all let go again if one cannot be bound. No SO_REUSEPORT: a second
    daemon's bind fails and it stops."""
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


def worker_listeners(cfg: ServerConfig, workers: int) -> tuple[list[list[socket.socket]], list[UnixListener]]:
    """Bind every address of ``listen`` for ``workers`` processes: each TCP
    address once per worker (SO_REUSEPORT, after a check that no process
    holds it), each unix socket once for all; the i-th list of TCP sockets is
    worker i's. All let go again if one cannot be bound."""
    per_worker: list[list[socket.socket]] = [[] for _ in range(workers)]
    unix: list[UnixListener] = []
    try:
        for host, port in cfg.tcp_addresses:
            for probe in bind_tcp("listen", host, port):  # no SO_REUSEPORT: fails where anyone listens
                probe.close()
            for own in per_worker:
                own += bind_tcp("listen", host, port, reuse_port=True)
        for path in cfg.unix_paths:
            unix.append(bind_unix(path, cfg.unix_socket_mode, cfg.unix_socket_group))
    except ConfigError:
        close_listeners([s for own in per_worker for s in own], unix)
        raise
    return per_worker, unix


def foreign_listeners(socks: Iterable[socket.socket]) -> list[str]:
    """The TCP listeners on the addresses of ``socks`` that are not among
    them (another process that bound the port with SO_REUSEPORT too), as
    "HOST:PORT", from /proc/net/tcp and tcp6 (this network namespace)."""
    own = {os.fstat(s.fileno()).st_ino for s in socks}
    where: set[tuple[str, int]] = set()
    for s in socks:
        addr = s.getsockname()
        where.add((str(ipaddress.ip_address(addr[0])), int(addr[1])))
    found: list[str] = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "0A":  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # The kernel prints each 32-bit word of the address in host order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4)) if sys.byteorder == "little" else raw
            at = (str(ipaddress.ip_address(words)), int(hexport, 16))
            if at in where and int(f[9]) not in own:
                found.append(f"{at[0]}:{at[1]}" if ":" not in at[0] else f"[{at[0]}]:{at[1]}")
    return sorted(set(found))


def close_listeners(tcp: list[socket.socket], unix: list[UnixListener]) -> None:
    for sock in tcp:
        sock.close()
    for listener in unix:
        listener.remove()


def bind_tcp(setting: str, host: str, port: int, reuse_port: bool = False) -> list[socket.socket]:
    """Sockets bound, not yet listening, to every address ``host`` names
    (as asyncio's create_server binds them), for this daemon alone (with
    ``reuse_port``, for one of its workers: see :func:`worker_listeners`). A
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
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
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

"""The daemon's listening sockets: bound once, before the store opens (a
port in use stops start-up with one line), by the process that forks the
workers, which inherit the very same sockets."""

from __future__ import annotations

import socket

from kvstore.errors import ConfigError
from kvstore.server_config import UNIX, ServerConfig
from kvstore.transport.http.unix import UnixListener, bind_unix


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

"""Listening unix sockets (``listen = "unix:PATH"``): the same API as TCP for
clients on the same host, with access decided by the socket file's mode and
group instead of the network."""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat
from dataclasses import dataclass

from kvstore.errors import ConfigError

BACKLOG = 1024


@dataclass(frozen=True, slots=True)
class UnixListener:
    path: str
    sock: socket.socket
    inode: int  # of the socket file this process bound

    def remove(self) -> None:
        """Close the socket; remove its file if it is still the one bound here."""
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        self.sock.close()


def bind_unix(path: str, mode: int, group: str | None) -> UnixListener:
    """A listening, non-blocking unix socket at ``path`` with ``mode`` and
    ``group``. A stale socket file (nobody listens) is replaced; anything else
    at ``path`` stops start-up."""
    label = f"listen=unix:{path}"
    gid = _gid(group) if group else -1
    _clear_stale(path, label)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)  # nobody else can connect before the chmod below
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, mode)
        if gid >= 0:
            os.chown(path, -1, gid)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        return UnixListener(path, sock, os.lstat(path).st_ino)
    except OSError as e:
        sock.close()
        raise ConfigError(f"{label}: {e.strerror or e}") from None


def _gid(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"unix_socket_group={group!r}: no such group") from None


def _clear_stale(path: str, label: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{label}: the path exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # left by a daemon that died: nobody listens
        return
    except OSError as e:
        raise ConfigError(f"{label}: an existing socket there cannot be checked: {e.strerror or e}") from None
    finally:
        probe.close()
    raise ConfigError(f"{label}: another process is listening on it")

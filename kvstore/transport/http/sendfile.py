"""Direct blocks sent with ``sendfile(2)`` from their segment file.

uvloop's transports have no ``loop.sendfile``, so the daemon calls
``os.sendfile`` itself, on the event loop, on the connection's non-blocking
socket: the kernel copies (or, on TCP, references) page-cache pages into the
socket without the bytes passing through Python. It only does so when nothing
is buffered in the transport before it (the response's headers went out), so
bytes can never be reordered; it sends what the socket takes at once and
hands the rest to the transport as a view of the segment's mapping (the same
bytes, already verified), whose writes wait for the client with the usual
time limit. Under TLS (the transport encrypts) the mapping is sent instead.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import cast

from aiohttp import web

from kvstore.engine.api import DirectExtent
from kvstore.metrics import Metrics
from kvstore.transport.http.appkeys import METRICS
from kvstore.transport.http.respond import reset_connection, send

_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ESHUTDOWN)


def plain_socket_fd(transport: asyncio.BaseTransport | None) -> int | None:
    """The connection's socket, when bytes may be written to it directly: not
    TLS, not closing, nothing buffered in the transport."""
    if transport is None or transport.is_closing() or transport.get_extra_info("sslcontext") is not None:
        return None
    if cast("asyncio.WriteTransport", transport).get_write_buffer_size():
        return None
    sock = transport.get_extra_info("socket")
    return None if sock is None else int(sock.fileno())


def sendfile_now(sock_fd: int, file_fd: int, offset: int, count: int) -> int:
    """Send up to ``count`` bytes of ``file_fd`` at ``offset`` without
    waiting: returns how many the socket took."""
    sent = 0
    while sent < count:
        try:
            n = os.sendfile(sock_fd, file_fd, offset + sent, count - sent)
        except BlockingIOError:
            break
        except OSError as e:
            if e.errno in _GONE:
                raise ConnectionResetError(f"the client went during sendfile: {e.strerror}") from None
            raise
        if n == 0:
            break
        sent += n
    return sent


def sendfile_extent(transport: asyncio.BaseTransport | None, extent: DirectExtent, metrics: Metrics) -> int:
    """Send what the socket takes of ``extent`` at once with sendfile (0
    where the transport allows no direct write); the bytes sent. Raises
    ConnectionResetError when the client went. No await between looking
    the socket up and using it: a transport closes on this thread, so its
    descriptor cannot be closed (and its number reused) in between."""
    fd = plain_socket_fd(transport)
    if fd is None:
        return 0
    sent = sendfile_now(fd, extent.segment.fd, extent.offset, len(extent.view))
    metrics.inc("kvstore_http_sendfile_bytes_total", sent)
    return sent


async def send_extent(request: web.Request, resp: web.StreamResponse, extent: DirectExtent, use_sendfile: bool) -> None:
    """Send the bytes of ``extent`` on a prepared response."""
    sent = 0
    if use_sendfile:
        try:
            sent = sendfile_extent(request.transport, extent, request.app[METRICS])
        except ConnectionResetError:
            reset_connection(request)  # the kernel knew first: the transport learns it now
            raise
    if sent < len(extent.view):
        await send(request, resp, extent.view[sent:])

"""Writing answers: error bodies, and bytes a client must take in time."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

from aiohttp import web

from kvstore.errors import KVStoreError
from kvstore.transport.http.appkeys import config_of
from kvstore.transport.statuses import http_status


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def error_response(e: KVStoreError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(e.code, str(e)), status=http_status(e), headers=headers)


SEND_PIECE = 1 << 20


async def send(request: web.Request, resp: web.StreamResponse, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to a prepared response in pieces of SEND_PIECE bytes,
    each taken by the client within request_timeout_s. A client that stops
    reading is cut off (its connection aborted, counted as a disconnect)
    instead of holding its slot and the block's buffer for ever."""
    seconds = config_of(request).request_timeout_s
    view = memoryview(data).cast("B")
    for at in range(0, len(view), SEND_PIECE) if len(view) else (0,):
        try:
            async with asyncio.timeout(seconds):
                await resp.write(view[at : at + SEND_PIECE])
        except TimeoutError:
            reset_connection(request)
            raise ConnectionResetError(f"the client read nothing for {seconds} s") from None


def reset_connection(request: web.Request) -> None:
    """Abort the connection with a RST: the kernel drops what it still holds
    for the client instead of trying to deliver it after the close."""
    if request.transport is not None:
        reset_transport(request.transport)


def reset_transport(transport: asyncio.Transport) -> None:
    """:func:`reset_connection` for a transport without a request (the fast lane's)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()

"""Calls between the workers of one daemon, over the writer's unix socket.

Reader workers serve reads, but the writer owns access times (the quota's LRU
order and the TTL, access.py): every ``RELAY_S`` a reader hands the writer the
accesses it served. The route exists only on the writer and answers only on
the workers' private unix socket (in a 0700 directory only the daemon's user
can reach); on TCP and on the public unix sockets (``listen = unix:PATH``) it
is a 404 like any unknown path. It is not part of the API (docs/openapi.yaml
leaves out /_internal/).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
from aiohttp import web

from kvstore.errors import InvalidInput, NotFound
from kvstore.transport.http_common import STATE, STORE, store_of

log = logging.getLogger("kvstore.http.internal")
PREFIX = "/_internal/"
RELAY_S = 1.0
routes = web.RouteTableDef()


def _on_private_socket(request: web.Request) -> bool:
    """Whether ``request`` came over the workers' private socket (never a
    public ``unix:PATH`` listener, whose clients are tenants)."""
    transport = request.transport
    private = request.app[STATE]["writer_socket"]
    return transport is not None and private is not None and transport.get_extra_info("sockname") == private


@routes.post("/_internal/touches")
async def touches(request: web.Request) -> web.Response:
    if not _on_private_socket(request):
        raise NotFound("no such route")
    try:
        doc = json.loads(await request.read())
    except ValueError:
        raise InvalidInput("touches: not JSON") from None
    if not isinstance(doc, dict) or not all(
        isinstance(keys, dict) and all(isinstance(k, str) and isinstance(t, int) for k, t in keys.items())
        for keys in doc.values()
    ):
        raise InvalidInput("touches: expected {tenant: {key: unix ms}}")
    store_of(request).absorb_touches(doc)
    return web.Response(status=204)


async def relay_touches(app: web.Application, session: aiohttp.ClientSession) -> None:
    """A reader: hand the writer the accesses served here, every ``RELAY_S``."""
    while True:
        await asyncio.sleep(RELAY_S)
        pending = app[STORE].touches()
        if not pending:
            continue
        with contextlib.suppress(aiohttp.ClientError, ConnectionError, TimeoutError):
            async with session.post(
                "http://writer/_internal/touches", json=pending, timeout=aiohttp.ClientTimeout(total=10)
            ) as r:
                if r.status != 204:
                    log.warning("the writer refused access times: %s", r.status)

"""``GET /v1/events``: residency events as Server-Sent Events, and the
event bus's place in the daemon.

Each event is ``id: SEQ``, ``event: stored|removed|cleared`` and ``data:``
one JSON object (``seq``, ``ts``, ``tenant``, ``kind``, ``cause``, ``tier``,
``blocks`` with each block's key, size and engine identity). Sequence
numbers count the node's events, every tenant's, so a tenant's stream
skips the numbers of others; a loss is always said: ``event: gap`` with
``{"first", "last"}`` (gone from the backlog before a resumption, or
dropped because this client read too slowly), its ``id`` the last lost
one. ``Last-Event-ID`` (or ``?since=SEQ``, the first wanted) resumes within
the backlog. A tenant's token sees its own events; the admin token every
tenant's. A comment line every ``KEEPALIVE_S`` keeps idle streams open.

Events come from the writer (single or writer role): reader workers relay
this route to it like every write.
"""

from __future__ import annotations

import json

from aiohttp import web

from kvstore.errors import InvalidInput, NotFound
from kvstore.events.bus import EventBus, Gap
from kvstore.events.model import Event
from kvstore.transport.http.auth import is_admin, tenant_of
from kvstore.transport.http.query import query_int
from kvstore.transport.http.respond import send

routes = web.RouteTableDef()
EVENTS = web.AppKey("events", EventBus)
KEEPALIVE_S = 15.0


def sse_message(item: Event | Gap) -> str:
    """One Server-Sent Events message."""
    if isinstance(item, Gap):
        doc = json.dumps({"first": item.first, "last": item.last})
        return f"id: {item.last}\nevent: gap\ndata: {doc}\n\n"
    return f"id: {item.seq}\nevent: {item.kind}\ndata: {json.dumps(item.as_dict())}\n\n"


async def end_streams(app: web.Application) -> None:
    """On shutdown: the event streams end now (not after shutdown_timeout_s)."""
    if EVENTS in app:
        app[EVENTS].end()


MAX_SEQ = (1 << 63) - 1


def _since(request: web.Request) -> int | None:
    """The first sequence number wanted: after ``Last-Event-ID`` (an id this
    stream sent: decimal digits), or ``?since``; None for events from now on.
    An empty ``Last-Event-ID`` is none (an EventSource that has seen no id)."""
    last = request.headers.get("Last-Event-ID")
    since = query_int(request, "since", 0, MAX_SEQ)
    if last:
        if not (last.isascii() and last.isdigit() and len(last) <= 18):
            raise InvalidInput("header 'Last-Event-ID' must be an event sequence number (decimal digits, >= 0)")
        return int(last) + 1
    return since


@routes.get("/v1/events", allow_head=False)
async def events(request: web.Request) -> web.StreamResponse:
    tenant = None if is_admin(request) else tenant_of(request)
    if EVENTS not in request.app:
        raise NotFound("this process publishes no events")
    since = _since(request)
    sub = request.app[EVENTS].subscribe(tenant, since)
    try:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
        await send(request, resp, b": kvstore events\n\n")
        while True:
            items = await sub.next_batch(KEEPALIVE_S)
            if sub.ended or request.transport is None or request.transport.is_closing():
                break  # the daemon stops, or the client went away
            if not items:
                await send(request, resp, b": keepalive\n\n")
                continue
            await send(request, resp, "".join(sse_message(item) for item in items).encode())
        await resp.write_eof()
        return resp
    finally:
        sub.close()

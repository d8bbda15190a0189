"""Batch routes: many blocks per request, streamed both ways.

The byte layout is specified in docs/batch-framing.md (kvstore/transport/batchframe.py).
Memory stays bounded: a batch put holds at most ``_WINDOW`` blocks at once
(read one, store it while the next is read); a batch get reads at most
``_WINDOW`` blocks ahead of what it has written to the socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from kvstore.engine.api import Stored
from kvstore.errors import InvalidInput, KVStoreError, Misdirected, NotFound, RateLimited, TenantNotFound
from kvstore.events.model import BlockMeta
from kvstore.names import validate_client_key
from kvstore.transport import batchframe
from kvstore.transport.http.appkeys import METRICS, config_of, store_of
from kvstore.transport.http.auth import tenant_of
from kvstore.transport.http.bodies import BAD_BODY_FRAMING, BatchBody, Held, json_body, keys_field
from kvstore.transport.http.qos import ticket_of
from kvstore.transport.http.respond import error_body, send
from kvstore.transport.http.routes.fleet import adopted_store, refuse_misplaced
from kvstore.transport.statuses import http_status, item_answer

BATCH_TYPE = "application/x-kvstore-batch"  # docs/batch-framing.md
routes = web.RouteTableDef()
_WINDOW = 4


@routes.post("/v1/batch/put")
async def batch_put(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    store = store_of(request)
    cfg = config_of(request)
    metrics = request.app[METRICS]
    results: list[dict[str, Any]] = []
    pending: list[tuple[str, asyncio.Task[Stored]]] = []
    body = BatchBody(request)
    ticket = ticket_of(request)

    async def settle(upto: int) -> None:
        while len(pending) > upto:
            key, task = pending.pop(0)
            try:
                results.append({"key": key, "status": 201 if (await task).created else 200})
            except KVStoreError as e:  # NotAdmitted among them: a 202 item, nothing stored
                results.append(item_answer(key, e))

    def stored(held: Held) -> Callable[[asyncio.Task[Stored]], None]:
        # the block's bytes are no longer held (a cancelled put's memory is not reused)
        return lambda task: body.release(held, reuse=not task.cancelled())

    try:
        items = batchframe.read_put_items_meta(body, store.config.max_block_size, cfg.max_batch_keys)
        async for key, data, raw_meta in items:
            ticket.moved("in", len(data))
            try:
                meta = (
                    BlockMeta.from_json(raw_meta, f"item {len(pending) + len(results)} ({key}): meta")
                    if raw_meta
                    else None
                )
            except InvalidInput as e:
                body.release(body.take())
                await settle(0)
                results.append(item_answer(key, e))
                continue
            try:
                validate_client_key(key)
                refuse_misplaced(request, [key])  # a fleet node stores only its own keys
                await ticket.reserve("write", len(data))  # the item's bytes from its tenant's write limit
            except (InvalidInput, Misdirected, RateLimited) as e:
                body.release(body.take())
                await settle(0)
                results.append(item_answer(key, e))
                continue
            task = asyncio.ensure_future(store.put(tenant, key, data, meta))
            task.add_done_callback(stored(body.take()))
            pending.append((key, task))
            await settle(_WINDOW - 1)
        await settle(0)
    except KVStoreError as e:
        await settle(0)  # what was already accepted is reported, never lost silently
        doc = error_body(e.code, str(e))
        doc["results"] = results
        return web.json_response(doc, status=http_status(e), headers={"Retry-After": "1"} if e.retryable else None)
    except TimeoutError:
        await settle(0)
        doc = error_body("request_timeout", f"batch body stalled for {cfg.request_timeout_s} s")
        doc["results"] = results
        return web.json_response(doc, status=408)
    except RequestPayloadError:
        await settle(0)
        doc = error_body("bad_request", BAD_BODY_FRAMING)
        doc["results"] = results
        return web.json_response(doc, status=400)
    finally:
        body.close()
    metrics.observe("kvstore_http_batch_records", len(results), op="put")
    return web.json_response({"results": results})


@routes.post("/v1/batch/get")
async def batch_get(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    store = store_of(request)
    keys = keys_field(await json_body(request), config_of(request).max_batch_keys)
    metrics = request.app[METRICS]
    ticket = ticket_of(request)
    resp = web.StreamResponse(status=200, headers={"Content-Type": BATCH_TYPE})
    await resp.prepare(request)
    await resp.write(batchframe.MAGIC)

    async def get(key: str) -> bytearray | memoryview:
        try:
            return await store.get_buffer(tenant, key)
        except TenantNotFound:
            raise
        except NotFound:
            other = adopted_store(request.app, tenant, key)  # a dead node's block this node took over
            if other is None:
                raise
            return await other.get_buffer(tenant, key)

    def fetch(key: str) -> asyncio.Task[bytearray | memoryview]:
        coro: Awaitable[bytearray | memoryview] = get(key)
        return asyncio.ensure_future(coro)

    window = [fetch(k) for k in keys[:_WINDOW]]
    try:
        for i, key in enumerate(keys):
            task = window.pop(0)
            if i + _WINDOW < len(keys):
                window.append(fetch(keys[i + _WINDOW]))
            try:
                data: bytes | bytearray | memoryview = await task
                status = 200
                await ticket.reserve(
                    "read", len(data)
                )  # the item's bytes from its tenant's read limit: else a 429 item
            except KVStoreError as e:
                data, status = batchframe.error_payload(e.code, str(e)), http_status(e)
            await send(request, resp, batchframe.get_item_header(key, status, len(data)))
            await send(request, resp, data)
            if status == 200:
                ticket.moved("out", len(data))
        await resp.write(batchframe.END)
    finally:
        for t in window:
            t.cancel()
    await resp.write_eof()
    metrics.observe("kvstore_http_batch_records", len(keys), op="get")
    return resp

"""Writes: ``put`` and ``put_many`` to every owner of a key (replicas), and ``delete``.

First write wins on the daemon: an item's result is 201 (this call stored
it), 200 (it was stored already), 202 (not stored: the tenant's admission,
``admit_after``, declined it; not a failure, and not retried: a retry would
only count another offer) or None (failed), the best over its replicas
(:func:`best`). ``put_many`` writes through a write plan on a ``unix:`` owner
(write_plans.py), else sends one ``/v1/batch/put`` per owner (per
``max_batch_keys`` items), or, with ``transport="nixl"``, one NIXL write
per owner, falling back to HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from kvstore_client.answers import NOT_ADMITTED, PUT_RESULTS, best, check, json_answer
from kvstore_client.bodies import BuffersPayload
from kvstore_client.errors import KVStoreClientError
from kvstore_client.exchange import Exchange
from kvstore_client.keys import check_key
from kvstore_client.nixl import NixlFallback
from kvstore_client.nixl_link import NixlLink
from kvstore_client.sharding import Shards
from kvstore_client.wire import batchframe
from kvstore_client.wire.batchframe import BufferLike
from kvstore_client.write_plans import UnixPlanWriter, UploadPlanWriter

Metas = Sequence[Mapping[str, Any] | None]
META_HEADER = "Kvstore-Block-Meta"


class Writes:
    def __init__(
        self,
        exchange: Exchange,
        shards: Shards,
        nixl: NixlLink | None,
        plans: UnixPlanWriter | None = None,
        uploads: UploadPlanWriter | None = None,
        *,
        max_batch_keys: int,
        strict: bool,
    ) -> None:
        self._x = exchange
        self._shards = shards
        self._nixl = nixl
        self._plans = plans
        self._uploads = uploads
        self._max_batch_keys = max_batch_keys
        self._strict = strict

    async def put(self, key: str, data: BufferLike, meta: Mapping[str, Any] | None) -> int | None:
        """The best result over the key's owners (201, 200, 202), None
        when none answered one (and not all failed: else their error)."""
        check_key(key)
        if memoryview(data).nbytes == 0:
            raise KVStoreClientError("blocks are 1 byte or more", code="invalid_input")
        deadline = self._x.deadline()
        headers = {META_HEADER: meta_header(meta)} if meta is not None else None
        result: int | None = None

        async def fn(s: aiohttp.ClientSession) -> bool:
            nonlocal result
            body = BuffersPayload([data], "application/octet-stream")
            async with s.put(f"/v1/blocks/{key}", data=body, headers=headers) as r:
                await check(r, ok=(200, 201, NOT_ADMITTED))
                result = best(result, r.status)
                return r.status != NOT_ADMITTED

        stored = await self._x.on_all_owners(self._shards.owners(key), fn, deadline)
        return result if stored or result == NOT_ADMITTED else None

    async def delete(self, key: str) -> bool:
        check_key(key)

        async def fn(s: aiohttp.ClientSession) -> bool:
            async with s.delete(f"/v1/blocks/{key}") as r:
                await check(r, ok=(204,))
                return True

        return await self._x.on_all_owners(self._shards.owners(key), fn, self._x.deadline())

    async def put_many(self, items: list[tuple[str, BufferLike]], metas: Metas | None = None) -> list[int | None]:
        for k, _ in items:
            check_key(k)
        deadline = self._x.deadline()
        ok: list[int | None] = [None] * len(items)
        groups: dict[str, list[int]] = {}
        for i, (k, _) in enumerate(items):
            for url in self._shards.owners(k):
                groups.setdefault(url, []).append(i)
        # Write plans on unix: endpoints; then NIXL when asked for; then, for a
        # sealed tenant's blocks sealed here, uploads into a plan; the rest in batches.
        await self._planned(self._plans, groups, items, ok, metas)
        if self._nixl is not None:
            for url in list(groups):
                if await self._nixl_write(self._nixl, url, items, groups[url], ok, metas):
                    del groups[url]
        else:
            await self._planned(self._uploads, groups, items, ok, metas)
        calls = [
            self._chunk(url, items, idx[c : c + self._max_batch_keys], ok, deadline, metas)
            for url, idx in groups.items()
            for c in range(0, len(idx), self._max_batch_keys)
        ]
        errors = [r for r in await asyncio.gather(*calls, return_exceptions=True) if isinstance(r, BaseException)]
        for e in errors:
            if not isinstance(e, KVStoreClientError):
                raise e
        if errors and (self._strict or all(o is None for o in ok)):
            raise errors[0]
        return ok

    async def _planned(
        self,
        plans: UnixPlanWriter | UploadPlanWriter | None,
        groups: dict[str, list[int]],
        items: list[tuple[str, BufferLike]],
        ok: list[int | None],
        metas: Metas | None,
    ) -> None:
        """Store what ``plans`` can of each owner's items; ``groups`` keeps the rest."""
        if plans is None or not any(plans.usable(url) for url in groups):
            return
        headers = [meta_header(m) if m is not None else None for m in metas] if metas is not None else None
        for url in [u for u in groups if plans.usable(u)]:
            left = await plans.write(url, items, groups[url], ok, headers)
            if left:
                groups[url] = left
            else:
                del groups[url]

    async def _nixl_write(
        self,
        link: NixlLink,
        url: str,
        items: list[tuple[str, BufferLike]],
        idx: list[int],
        ok: list[int | None],
        metas: Metas | None,
    ) -> bool:
        """Put ``items[idx]`` on ``url`` over NIXL; False: HTTP must."""
        ep = self._x.endpoints[url]
        if not link.usable(ep):
            return False
        chosen = [(items[i][0], memoryview(items[i][1]).cast("B")) for i in idx]
        ids = [metas[i] for i in idx] if metas is not None else None
        try:
            results = await link.agent().write(self._x.session(ep), url, chosen, ids)
        except (TimeoutError, NixlFallback, aiohttp.ClientError, OSError) as e:
            link.failed(ep, e)
            return False
        for i, res in zip(idx, results, strict=True):
            _stored(ok, i, res)
        self._x.stats["nixl_writes"] += len(idx)
        return True

    async def _chunk(
        self,
        url: str,
        items: list[tuple[str, BufferLike]],
        idx: list[int],
        ok: list[int | None],
        deadline: float,
        metas: Metas | None,
    ) -> None:
        ids = [_meta_json_or_none(metas[i]) for i in idx] if metas is not None else None

        async def fn(s: aiohttp.ClientSession) -> None:
            parts = batchframe.put_stream_parts((items[i] for i in idx), ids)
            body = BuffersPayload(parts, batchframe.CONTENT_TYPE)
            async with s.post("/v1/batch/put", data=body) as r:
                if r.status in (200, 400, 413) and r.content_type == "application/json":
                    doc = await json_answer(r)
                    results = doc.get("results")
                    if isinstance(results, list):
                        for i, res in zip(idx, results, strict=False):
                            _stored(ok, i, res)
                        if r.status == 200:
                            return
                await check(r, ok=())

        await self._x.attempts(self._x.endpoints[url], fn, deadline)


def _stored(ok: list[int | None], i: int, res: Any) -> None:
    """Record item ``i``'s put result (a batch or NIXL item): the best
    across replicas (:func:`best`); None (failed) if none stored it."""
    if isinstance(res, dict) and res.get("status") in PUT_RESULTS:
        ok[i] = best(ok[i], int(res["status"]))


def meta_json(meta: Mapping[str, Any]) -> bytes:
    """A block identity (``block_hash``, ``parent_block_hash``, ``token_ids``,
    ``block_size``, ``lora_id``, ``lora_name``, ``extra_keys``) as compact JSON."""
    if "block_hash" not in meta:
        raise ValueError("a block identity needs 'block_hash'")
    return json.dumps(dict(meta), separators=(",", ":")).encode()


def _meta_json_or_none(meta: Mapping[str, Any] | None) -> bytes | None:
    return None if meta is None else meta_json(meta)


def meta_header(meta: Mapping[str, Any]) -> str:
    """The ``Kvstore-Block-Meta`` header's value: base64url, no padding."""
    return base64.urlsafe_b64encode(meta_json(meta)).decode().rstrip("=")

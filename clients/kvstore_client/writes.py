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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp

from kvstore_client.answers import MISDIRECTED, NOT_ADMITTED, PUT_RESULTS, best, check, json_answer
from kvstore_client.bodies import BuffersPayload
from kvstore_client.errors import KVStoreClientError, ServerError
from kvstore_client.exchange import Call, Exchange
from kvstore_client.keys import check_key
from kvstore_client.nixl import NixlFallback
from kvstore_client.nixl_link import NixlLink
from kvstore_client.sharding import Shards
from kvstore_client.wire import batchframe
from kvstore_client.wire.batchframe import BufferLike
from kvstore_client.wire.headers import FLEET_VERSION
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
        self._misdirected: Callable[[str], Awaitable[str]] | None = None
        self._fleet_version: Callable[[], int] | None = None
        self._shards = shards
        self._nixl = nixl
        self._plans = plans
        self._uploads = uploads
        self._max_batch_keys = max_batch_keys
        self._strict = strict

    def follow(self, misdirected: Callable[[str], Awaitable[str]], version: Callable[[], int]) -> None:
        """A fleet client's writes: one a node refused with 421 (the key is
        another node's) is sent once more where the fleet places it now;
        ``misdirected`` reads the membership again and answers the named
        owner's URL (fleet.FleetMembers.misdirected). Each write says the
        membership's ``version`` it was placed by (``Kvstore-Fleet-Version``),
        so a node that has not seen it yet does not refuse it."""
        self._misdirected, self._fleet_version = misdirected, version

    def _headers(self, meta: Mapping[str, Any] | None = None) -> dict[str, str] | None:
        """A write's own headers: the block's identity, the fleet's version."""
        headers = {META_HEADER: meta_header(meta)} if meta is not None else {}
        if self._fleet_version is not None:
            headers[FLEET_VERSION] = str(self._fleet_version())
        return headers or None

    async def put(self, key: str, data: BufferLike, meta: Mapping[str, Any] | None) -> int | None:
        """The best result over the key's owners (201, 200, 202), None
        when none answered one (and not all failed: else their error)."""
        check_key(key)
        if memoryview(data).nbytes == 0:
            raise KVStoreClientError("blocks are 1 byte or more", code="invalid_input")
        deadline = self._x.deadline()
        result: int | None = None

        async def fn(s: aiohttp.ClientSession) -> bool:
            nonlocal result
            body = BuffersPayload([data], "application/octet-stream")
            async with s.put(f"/v1/blocks/{key}", data=body, headers=self._headers(meta)) as r:
                await check(r, ok=(200, 201, NOT_ADMITTED))
                result = best(result, r.status)
                return r.status != NOT_ADMITTED

        stored = await self._on_owners(key, fn, deadline)
        return result if stored or result == NOT_ADMITTED else None

    async def _on_owners(self, key: str, fn: Call[bool], deadline: float) -> bool:
        """``fn`` on every owner of ``key``; on a fleet, once more where the
        fleet places it now if the node asked answered 421 (it is another's)."""
        try:
            return await self._x.on_all_owners(self._shards.owners(key), fn, deadline)
        except ServerError as e:
            if e.status != MISDIRECTED or e.owner is None or self._misdirected is None:
                raise
            return await self._x.on_all_owners(await self._placed(key, e.owner), fn, deadline)

    async def _placed(self, key: str, named: str) -> list[str]:
        """The owners of ``key`` after a node named ``named`` its owner (421):
        the membership read again, by which it is placed (a node that named a
        member the fleet has declared dead had not seen that yet)."""
        assert self._misdirected is not None
        url = await self._misdirected(named)
        owners = self._shards.owners(key)
        # The membership just read is the newest any member has: trust it, unless it still
        # lists the named node alive (this client could not read a newer one).
        return owners if url in owners or url not in self._shards.urls else [url]

    async def delete(self, key: str) -> bool:
        check_key(key)

        async def fn(s: aiohttp.ClientSession) -> bool:
            async with s.delete(f"/v1/blocks/{key}", headers=self._headers()) as r:
                await check(r, ok=(204,))
                return True

        return await self._on_owners(key, fn, self._x.deadline())

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
        moved: dict[int, str] = {}  # items a fleet node refused (421): their owner as it named it
        errors = await self._batches(groups, items, ok, deadline, metas, moved)
        if moved and self._misdirected is not None:  # once more, where the fleet places them now
            again: dict[str, list[int]] = {}
            for i, named in sorted(moved.items()):
                for url in await self._placed(items[i][0], named):
                    again.setdefault(url, []).append(i)
            errors += await self._batches(again, items, ok, deadline, metas, None)
        for e in errors:
            if not isinstance(e, KVStoreClientError):
                raise e
        if errors and (self._strict or all(o is None for o in ok)):
            raise errors[0]
        return ok

    async def _batches(
        self,
        groups: dict[str, list[int]],
        items: list[tuple[str, BufferLike]],
        ok: list[int | None],
        deadline: float,
        metas: Metas | None,
        moved: dict[int, str] | None,
    ) -> list[BaseException]:
        """One ``/v1/batch/put`` per owner (per ``max_batch_keys`` items), at
        once; the errors of those that failed."""
        calls = [
            self._chunk(url, items, idx[c : c + self._max_batch_keys], ok, deadline, metas, moved)
            for url, idx in groups.items()
            for c in range(0, len(idx), self._max_batch_keys)
        ]
        return [r for r in await asyncio.gather(*calls, return_exceptions=True) if isinstance(r, BaseException)]

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
        moved: dict[int, str] | None,
    ) -> None:
        ids = [_meta_json_or_none(metas[i]) for i in idx] if metas is not None else None

        async def fn(s: aiohttp.ClientSession) -> None:
            parts = batchframe.put_stream_parts((items[i] for i in idx), ids)
            body = BuffersPayload(parts, batchframe.CONTENT_TYPE)
            async with s.post("/v1/batch/put", data=body, headers=self._headers()) as r:
                if r.status in (200, 400, 413) and r.content_type == "application/json":
                    doc = await json_answer(r)
                    results = doc.get("results")
                    if isinstance(results, list):
                        for i, res in zip(idx, results, strict=False):
                            _stored(ok, i, res)
                            if moved is not None and _misdirected(res):
                                moved[i] = str(res["owner"])
                        if r.status == 200:
                            return
                await check(r, ok=())

        await self._x.attempts(self._x.endpoints[url], fn, deadline)


def _stored(ok: list[int | None], i: int, res: Any) -> None:
    """Record item ``i``'s put result (a batch or NIXL item): the best
    across replicas (:func:`best`); None (failed) if none stored it."""
    if isinstance(res, dict) and res.get("status") in PUT_RESULTS:
        ok[i] = best(ok[i], int(res["status"]))


def _misdirected(res: Any) -> bool:
    """A batch item a fleet node refused: the key is another node's (its ``owner``)."""
    return isinstance(res, dict) and res.get("status") == MISDIRECTED and isinstance(res.get("owner"), str)


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

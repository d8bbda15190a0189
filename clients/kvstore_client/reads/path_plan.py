"""Reads through read plans with paths (``plan_paths=True``, http(s) endpoints).

A host that mounts the daemon's data directory at the same path reads a
block from its segment file itself: ``POST /v1/read-plan`` with
``{"paths": true}`` names the files, under a lease, one plan per key. A
plan refused (``paths_not_offered``: never asked again here;
``insecure_transport`` for a sealed block on plain TCP; 409) or a file that
cannot be read here (not mounted, no permission, gone) leaves the key for
HTTP. So does a block that fails its checksums (once, never returned): the
file may have been compacted away and its name taken again after the lease
ended; the daemon checks what it sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvstore_client.answers import error_from, json_answer
from kvstore_client.errors import CorruptBlock, KVStoreClientError
from kvstore_client.exchange import Endpoint
from kvstore_client.plans import Plan, PlanConnection, parse_plan
from kvstore_client.reads.base import LEFT, Left, Outcome, PlanReader, Served, each, planned, planned_miss
from kvstore_client.sharding import UNIX


class PathPlanReader(PlanReader):
    def asks(self, url: str) -> bool:
        """Whether get_into asks ``url`` (http or https) for plans with paths."""
        return self._enabled and not url.startswith(UNIX) and self._x.endpoints[url].paths_offered

    async def read(self, keys: Sequence[str], bufs: Sequence[memoryview], todo: list[int]) -> Served:
        mine = [i for i in todo if self.asks(self._shards.owners(keys[i])[0])]
        got = await each(mine, lambda i: self._read(keys[i], bufs[i]))
        served: dict[int, Outcome] = {i: o for i, o in got.items() if not isinstance(o, Left)}
        return served, [i for i in todo if i not in served]

    async def _read(self, key: str, mv: memoryview) -> Outcome | Left:
        got = await self._path_read(self._x.endpoints[self._shards.owners(key)[0]], key, mv)
        self._x.stats["plan_fallbacks" if isinstance(got, Left) else "plan_reads"] += 1
        return got

    async def _path_read(self, ep: Endpoint, key: str, mv: memoryview) -> Outcome | Left:
        """``key`` read through a plan with paths into ``mv``: its size,
        None for a miss, or LEFT when it must be read with GET."""
        if ep.breaker.state != "closed":
            return LEFT  # GET: the breaker decides
        try:
            plan = await self.plan(ep, [key], None)
        except KVStoreClientError as e:
            self._x.log.warning("kvstore read plan with paths failed, reading over HTTP: %s", e)
            return LEFT
        try:
            block = planned(plan, key, mv, self._decode)
            if block is None:
                return None if planned_miss(plan, key) else LEFT
            try:
                return await asyncio.to_thread(PlanConnection.read_into, block, mv, self._decoders.get())
            except (OSError, CorruptBlock) as e:
                self._x.log.warning("kvstore read of %s from its path failed, reading over HTTP: %s", key, e)
                return LEFT
        finally:
            try:
                await self.release(ep, plan.lease)
            except KVStoreClientError as e:  # it expires on its own
                self._x.log.warning("kvstore read plan release failed: %s", e)

    async def plan(self, ep: Endpoint, keys: list[str], lease_s: float | None) -> Plan:
        """``POST /v1/read-plan`` with paths on an http(s) endpoint's session."""
        body: dict[str, Any] = {"keys": keys, "paths": True}
        if lease_s is not None:
            body["lease_s"] = lease_s

        async def call() -> dict[str, Any]:
            async with self._x.session(ep).post("/v1/read-plan", json=body) as r:
                if r.status != 200:
                    err = error_from(r.status, await r.read(), r)
                    if err.code == "paths_not_offered":
                        ep.paths_offered = False  # not asked again; read_plan still raises
                    err.endpoint = ep.url
                    raise err
                return await json_answer(r)

        doc = await self._x.request(ep, "read plan", call())
        return parse_plan(doc, "", {}, endpoint=ep.url)

    async def release(self, ep: Endpoint, lease: str) -> None:
        """``DELETE /v1/read-plan/{lease}``: the daemon may compact and drop the plan's segments again."""

        async def call() -> None:
            async with self._x.session(ep).delete(f"/v1/read-plan/{lease}") as r:
                if r.status != 204:
                    raise error_from(r.status, await r.read(), r)

        await self._x.request(ep, "answer", call())

"""Reads over NIXL (``transport="nixl"``): one control call and one transfer per owner.

A key NIXL cannot serve (the daemon has no agent, the transfer failed, the
bytes did not verify) is left for the next reader; a buffer too small ends
that key's read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp

from kvstore_client.errors import BufferTooSmall
from kvstore_client.exchange import Exchange
from kvstore_client.nixl import NixlFallback
from kvstore_client.nixl_link import NixlLink
from kvstore_client.reads.base import Outcome, Served
from kvstore_client.sharding import Shards


class NixlReader:
    def __init__(self, exchange: Exchange, shards: Shards, link: NixlLink, max_batch_keys: int) -> None:
        self._x = exchange
        self._shards = shards
        self._link = link
        self._max_batch_keys = max_batch_keys

    async def read(self, keys: Sequence[str], bufs: Sequence[memoryview], todo: list[int]) -> Served:
        served: dict[int, Outcome] = {}
        groups = self._shards.by_first_owner(keys, todo)
        await asyncio.gather(*(self._owner(url, keys, bufs, idx, served) for url, idx in groups.items()))
        return served, [i for i in todo if i not in served]

    async def _owner(
        self, url: str, keys: Sequence[str], bufs: Sequence[memoryview], idx: list[int], served: dict[int, Outcome]
    ) -> None:
        ep = self._x.endpoints[url]
        if not self._link.usable(ep):
            return
        for c in range(0, len(idx), self._max_batch_keys):
            part = idx[c : c + self._max_batch_keys]
            try:
                got = await self._link.agent().read_many(
                    self._x.session(ep),
                    ep.url,
                    [keys[i] for i in part],
                    [bufs[i] for i in part],
                    time.monotonic() + self._x.timeout,
                )
            except (NixlFallback, TimeoutError, aiohttp.ClientError, OSError) as e:
                self._link.failed(ep, e)
                return
            for i, g in zip(part, got, strict=True):
                if isinstance(g, NixlFallback):
                    self._link.failed(ep, g)
                elif isinstance(g, BufferTooSmall):
                    served[i] = g
                elif not isinstance(g, Exception):
                    served[i] = g
                    self._x.stats["nixl_reads"] += 1

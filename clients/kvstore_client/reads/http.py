"""Reads over HTTP: the last reader, which serves every key it is handed.

Each key is read from its owners in rank order (replicas), with retries,
the breaker and the call's deadline (kvstore_client/exchange.py). On each
endpoint it is the record as stored, decoded here, where that endpoint
decodes here (kvstore_client/reads/records.py), else ``GET /v1/blocks``,
its body written chunk by chunk into the caller's buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp

from kvstore_client.answers import Miss, check
from kvstore_client.errors import BufferTooSmall, UnavailableError
from kvstore_client.exchange import Exchange
from kvstore_client.reads.base import Served, each, too_small
from kvstore_client.reads.records import RecordReader, ServerDecodes
from kvstore_client.sharding import Shards


class HttpReader:
    def __init__(self, exchange: Exchange, shards: Shards, records: RecordReader) -> None:
        self._x = exchange
        self._shards = shards
        self._records = records

    async def read(self, keys: Sequence[str], bufs: Sequence[memoryview], todo: list[int]) -> Served:
        return dict(await each(todo, lambda i: self.get_into(keys[i], bufs[i]))), []

    async def get_into(self, key: str, mv: memoryview) -> int | None:
        """``key`` into ``mv``: its size, None if its owners do not have it."""

        def dest(n: int) -> memoryview:
            if n > mv.nbytes:
                raise too_small(key, n, mv)
            return mv[:n]

        async def fn(s: aiohttp.ClientSession) -> int:
            if self._records.here(s):
                try:
                    return await self._records.read(s, key, None, dest)
                except ServerDecodes:
                    pass
            async with s.get(f"/v1/blocks/{key}") as r:
                await check(r, ok=(200,))
                size = r.content_length
                if size is not None and size > mv.nbytes:
                    raise too_small(key, size, mv)
                n = 0
                async for chunk in r.content.iter_any():
                    end = n + len(chunk)
                    if end > mv.nbytes:
                        raise BufferTooSmall(f"block {key} is over {n} bytes; the buffer holds {mv.nbytes}")
                    mv[n:end] = chunk
                    n = end
                if size is not None and n != size:
                    raise UnavailableError(f"block {key}: body ended after {n} of {size} bytes")
                return n

        return await self._x.on_owners(self._shards.owners(key), fn, self._x.deadline())

    async def get(self, key: str, rng: tuple[int, int] | None) -> bytes | None:
        """The block (or bytes ``rng`` of it), None if its owners do not have it."""
        headers = {"Range": f"bytes={rng[0]}-{rng[1] - 1}"} if rng else {}

        async def fn(s: aiohttp.ClientSession) -> bytes:
            if self._records.here(s):
                out: list[bytearray] = []

                def dest(n: int) -> memoryview:
                    out.append(bytearray(n))
                    return memoryview(out[0])

                try:
                    await self._records.read(s, key, rng, dest)
                    return bytes(out[0])
                except ServerDecodes:
                    pass
            async with s.get(f"/v1/blocks/{key}", headers=headers) as r:
                if rng is not None and r.status == 416:
                    raise Miss
                await check(r, ok=(200, 206))
                data = await r.read()
                if rng is not None and r.status == 200:  # range ignored by the server
                    data = data[rng[0] : rng[1]]
                return data

        return await self._x.on_owners(self._shards.owners(key), fn, self._x.deadline())

    async def exists(self, key: str) -> bool:
        async def fn(s: aiohttp.ClientSession) -> bool:
            async with s.head(f"/v1/blocks/{key}") as r:
                await check(r, ok=(200,))
                return True

        return bool(await self._x.on_owners(self._shards.owners(key), fn, self._x.deadline()))

"""``get_many``: blocks as bytes through ``/v1/batch/get``, one call per owner and rank.

Keys go to their first owners; those not found (or whose call failed) to
their next owners, rank by rank. A retry after a cut stream asks only for
the keys not yet received.
"""

from __future__ import annotations

import asyncio

import aiohttp

from kvstore_client.answers import check, error_from
from kvstore_client.errors import KVStoreClientError, ProtocolError
from kvstore_client.exchange import Exchange
from kvstore_client.sharding import Shards, group
from kvstore_client.wire import batchframe
from kvstore_client.wire.errors import BadFraming


class BatchGet:
    def __init__(self, exchange: Exchange, shards: Shards, *, max_batch_keys: int, strict: bool) -> None:
        self._x = exchange
        self._shards = shards
        self._max_batch_keys = max_batch_keys
        self._strict = strict

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        deadline = self._x.deadline()
        out: list[bytes | None] = [None] * len(keys)
        owners = [self._shards.owners(k) for k in keys]
        errors: list[KVStoreClientError] = []
        answered = False
        for rank in range(self._shards.replicas):
            groups = group((i for i in range(len(keys)) if out[i] is None), owners, rank)
            calls = [
                self._chunk(url, keys, idx[c : c + self._max_batch_keys], out, deadline)
                for url, idx in groups.items()
                for c in range(0, len(idx), self._max_batch_keys)
            ]
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, KVStoreClientError):
                    errors.append(result)
                elif isinstance(result, BaseException):
                    raise result
                else:
                    answered = True
        if errors and (self._strict or not answered):
            raise errors[0]
        if errors:
            self._x.log.warning("kvstore get_many: %d partial failures, first: %s", len(errors), errors[0])
        return out

    async def _chunk(self, url: str, keys: list[str], idx: list[int], out: list[bytes | None], deadline: float) -> None:
        """One batch get; a retry after a cut stream asks only for the keys not yet received."""
        pending = list(idx)

        async def fn(s: aiohttp.ClientSession) -> None:
            nonlocal pending
            body = {"keys": [keys[i] for i in pending]}
            async with s.post("/v1/batch/get", json=body) as r:
                await check(r, ok=(200,))
                if r.content_type != batchframe.CONTENT_TYPE:
                    raise ProtocolError(f"batch get answered {r.content_type}, not {batchframe.CONTENT_TYPE}")
                item_error: KVStoreClientError | None = None
                try:
                    async for key, status, payload in batchframe.read_get_items(r.content):
                        if not pending or key != keys[pending[0]]:
                            raise ProtocolError(f"batch get answered key {key!r} out of order")
                        i = pending.pop(0)
                        if status == 200:
                            out[i] = payload
                        elif status != 404 and item_error is None:
                            item_error = error_from(status, payload)
                except BadFraming as e:
                    raise ProtocolError(str(e)) from None
                if pending:
                    raise ProtocolError(f"batch get did not answer {len(pending)} keys")
                if item_error is not None and self._strict:
                    raise item_error

        await self._x.attempts(self._x.endpoints[url], fn, deadline)

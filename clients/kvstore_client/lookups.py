"""Which keys are stored: ``/v1/lookup`` (with leases that lock what it
found), the leases' release, and the key listing.

A lookup asks each key's owners rank by rank, one call per owner (per
``max_lookup_keys`` keys); a key is present if any owner has it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvstore_client.answers import Miss, check, json_answer
from kvstore_client.errors import KVStoreClientError, ProtocolError
from kvstore_client.exchange import Exchange
from kvstore_client.keys import check_key
from kvstore_client.sharding import Shards, group


@dataclass(frozen=True, slots=True)
class Locks:
    """The leases a :meth:`AsyncClient.lookup_and_lock` took: (endpoint URL,
    lease id), one per daemon call that found keys."""

    leases: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.leases)


class Lookups:
    def __init__(self, exchange: Exchange, shards: Shards, *, max_lookup_keys: int) -> None:
        self._x = exchange
        self._shards = shards
        self._max_lookup_keys = max_lookup_keys

    async def lookup(
        self,
        keys: list[str],
        tokens_per_block: int | None = None,
        lease_s: float | None = None,
        leases: list[tuple[str, str]] | None = None,
    ) -> list[bool]:
        """Per key, whether it is stored; with ``lease_s``, each lease taken
        is appended to ``leases``."""
        for k in keys:
            check_key(k)
        deadline = self._x.deadline()
        present = [False] * len(keys)
        owners = [self._shards.owners(k) for k in keys]
        errors: list[KVStoreClientError] = []
        answered = [False] * len(keys)
        for rank in range(self._shards.replicas):
            groups = group((i for i in range(len(keys)) if not present[i]), owners, rank)
            calls = []
            for url, idx in groups.items():
                for c in range(0, len(idx), self._max_lookup_keys):
                    part = idx[c : c + self._max_lookup_keys]
                    calls.append(self._chunk(url, keys, part, deadline, tokens_per_block, lease_s, leases))
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, KVStoreClientError):
                    errors.append(result)
                    continue
                if isinstance(result, BaseException):
                    raise result
                for i, p in result:
                    present[i] = present[i] or p
                    answered[i] = True
        if errors and not any(answered):
            raise errors[0]
        if errors:
            self._x.log.warning("kvstore lookup: %d partial failures, first: %s", len(errors), errors[0])
        return present

    async def _chunk(
        self,
        url: str,
        keys: list[str],
        idx: list[int],
        deadline: float,
        tokens_per_block: int | None = None,
        lease_s: float | None = None,
        leases: list[tuple[str, str]] | None = None,
    ) -> list[tuple[int, bool]]:
        """One ``/v1/lookup`` call; with ``lease_s``, the lease it took (if
        any key was present) is appended to ``leases``."""
        body: dict[str, Any] = {"keys": [keys[i] for i in idx]}
        if tokens_per_block:
            body["tokens_per_block"] = tokens_per_block
        if lease_s is not None:
            body["lease_s"] = lease_s

        async def fn(s: aiohttp.ClientSession) -> list[tuple[int, bool]]:
            async with s.post("/v1/lookup", json=body) as r:
                await check(r, ok=(200,))
                doc = await json_answer(r)
                flags = doc.get("present")
                if not isinstance(flags, list) or len(flags) != len(idx):
                    raise ProtocolError(f"lookup answer has no 'present' list of {len(idx)} flags")
                if lease_s is not None:
                    lease = doc.get("lease")
                    if lease is None and any(flags):
                        raise ProtocolError("a lookup with lease_s found keys but named no lease (an older daemon?)")
                    if lease is not None:
                        if not isinstance(lease, str) or not lease.isalnum():
                            raise ProtocolError(f"lookup answer has a malformed lease {lease!r}")
                        assert leases is not None
                        leases.append((url, lease))
                return [(i, bool(p)) for i, p in zip(idx, flags, strict=True)]

        return await self._x.attempts(self._x.endpoints[url], fn, deadline)

    async def release(self, leases: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """End ``leases``: those still to release (their daemon could not be reached)."""
        deadline = self._x.deadline()

        async def one(url: str, lease: str) -> bool:
            async def fn(s: aiohttp.ClientSession) -> bool:
                async with s.delete(f"/v1/leases/{lease}") as r:
                    with contextlib.suppress(Miss):  # expired, or released already: nothing is held
                        await check(r, ok=(204,))
                    return True

            try:
                return await self._x.attempts(self._x.endpoints[url], fn, deadline)
            except KVStoreClientError as e:
                self._x.log.warning("kvstore lease release at %s failed: %s", url, e)
                return False

        done = await asyncio.gather(*(one(u, lid) for u, lid in leases))
        return [ul for ul, ok in zip(leases, done, strict=True) if not ok]

    async def stats(self, url: str) -> dict[str, Any]:
        """``GET /v1/stats`` of ``url``: the tenant's usage there and its QoS."""

        async def fn(s: aiohttp.ClientSession) -> dict[str, Any]:
            async with s.get("/v1/stats") as r:
                await check(r, ok=(200,))
                doc = await json_answer(r)
            if not isinstance(doc, dict):
                raise ProtocolError("malformed stats: not an object")
            return doc

        return await self._x.attempts(self._x.endpoints[url], fn, self._x.deadline())

    async def list_keys(
        self, url: str, prefix: str, start_after: str | None, limit: int
    ) -> tuple[list[tuple[str, int]], str | None]:
        """One page of ``GET /v1/keys`` from ``url``."""
        params = {"limit": str(limit)}
        if prefix:
            params["prefix"] = prefix
        if start_after is not None:
            params["start_after"] = start_after

        async def fn(s: aiohttp.ClientSession) -> tuple[list[tuple[str, int]], str | None]:
            async with s.get("/v1/keys", params=params) as r:
                await check(r, ok=(200,))
                doc = await json_answer(r)
            try:
                keys = [(str(e["key"]), int(e["size"])) for e in doc["keys"]]
                nxt = doc["next_start_after"]
            except (KeyError, TypeError, ValueError) as e:
                raise ProtocolError(f"malformed key listing: {type(e).__name__}: {e}") from None
            return keys, (None if nxt is None else str(nxt))

        try:
            return await self._x.attempts(self._x.endpoints[url], fn, self._x.deadline())
        except Miss:
            raise ProtocolError("the daemon has no key listing (404): an older version?") from None

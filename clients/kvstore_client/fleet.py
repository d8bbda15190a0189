"""A client of a fleet (``AsyncClient(seeds, token, fleet=True)``): the
endpoints it was given are seeds; the members come from ``GET /v1/fleet``.

Before a call, :meth:`FleetMembers.ensure` reads the membership again when it
is due: every ``refresh_s``, and at once (at most every
:data:`ERROR_REFRESH_S`) while a member's circuit breaker is open, since a
dead node is what the daemons will soon declare dead. Keys are placed with
the daemons' own rendezvous hashing over the alive members' URLs, so a
client and every node agree on who serves a key. Every seed and known member
is asked; the answer with the highest ``version`` wins (a node that has not
caught up yet answers an older one). Members are added to the client's
endpoints as they appear and never removed (their sessions and breakers are
kept for when they come back): placement uses the alive ones only. A member
that comes back (alive again, or a new incarnation) has its circuit breaker
probed at once: it opened while the node was away, and its cooldown would
make every one of its keys a miss for seconds after the node serves again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from kvstore_client.answers import check, json_answer
from kvstore_client.errors import ProtocolError
from kvstore_client.exchange import Endpoint, Exchange
from kvstore_client.sharding import Shards, normalize

ERROR_REFRESH_S = 0.5


class FleetMembers:
    def __init__(
        self,
        exchange: Exchange,
        shards: Shards,
        seeds: list[str],
        refresh_s: float,
        make_endpoint: Callable[[str], Endpoint],
    ) -> None:
        if refresh_s <= 0:
            raise ValueError(f"fleet_refresh_s must be > 0, got {refresh_s}")
        self._x = exchange
        self._shards = shards
        self.seeds = list(seeds)
        self.refresh_s = refresh_s
        self._make = make_endpoint
        self.replicas = shards.replicas  # as asked; placement uses at most the alive members
        self.version = -1
        self._due = 0.0  # monotonic: the next scheduled refresh
        self._last = -1e9  # monotonic: the last refresh
        self._lock = asyncio.Lock()
        self._incarnations: dict[str, int] = {}  # each alive member's, as last read

    async def ensure(self) -> None:
        """Read the membership if it is due (or a member looks down)."""
        now = time.monotonic()
        down = any(self._x.endpoints[u].breaker.state != "closed" for u in self._shards.urls)
        if now < self._due and not (down and now - self._last >= ERROR_REFRESH_S):
            return
        async with self._lock:
            if time.monotonic() - self._last < ERROR_REFRESH_S and self.version >= 0:
                return  # another call just did
            await self.refresh()

    async def misdirected(self, owner: str) -> str:
        """A node answered ``421 misdirected``: the key is ``owner``'s in its
        view of the fleet, newer than this client's. Read the membership now
        (every caller covered by one read that began after it asked: the
        refusals of one batch cost one read) and know ``owner``'s endpoint;
        returns its normalized URL."""
        asked = time.monotonic()
        async with self._lock:
            if self._last < asked:
                await self.refresh()
        url = normalize(owner)
        if url not in self._x.endpoints:
            self._x.endpoints[url] = self._make(url)
        return url

    async def refresh(self) -> bool:
        """Ask every seed and known member; apply the newest answer. False if
        none answered (the endpoints stay as they were)."""
        self._last = time.monotonic()
        self._due = self._last + self.refresh_s
        asked = list(dict.fromkeys([*self.seeds, *self._x.endpoints]))
        answers = await asyncio.gather(*(self._ask(u) for u in asked), return_exceptions=True)
        docs = [a for a in answers if isinstance(a, dict)]
        if not docs:
            return False
        best = max(docs, key=lambda d: int(d.get("version", -1)))
        version = int(best.get("version", -1))
        if version < self.version:
            return False
        members = [n for n in best.get("nodes", []) if n.get("state") == "alive"]
        alive = sorted(normalize(str(n["url"])) for n in members)
        if not alive:
            return False
        for u in alive:
            if u not in self._x.endpoints:
                self._x.endpoints[u] = self._make(u)
        for n in members:  # a node back (alive again, a new incarnation): its breaker opened while it was away
            u, incarnation = normalize(str(n["url"])), int(n.get("incarnation", 0))
            if self._incarnations.get(u, incarnation) != incarnation or u not in self._shards.urls:
                self._x.endpoints[u].breaker.probe_now()
            self._incarnations[u] = incarnation
        self._shards.urls = alive
        self._shards.replicas = min(self.replicas, len(alive))
        self.version = version
        return True

    async def _ask(self, url: str) -> dict[str, Any]:
        ep = self._x.endpoints.get(url) or self._make(url)
        self._x.endpoints.setdefault(url, ep)

        async def fn(s: aiohttp.ClientSession) -> dict[str, Any]:
            async with s.get("/v1/fleet") as r:
                await check(r, ok=(200,))
                doc = await json_answer(r)
            if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
                raise ProtocolError("malformed fleet document")
            return doc

        return await self._x.attempts(ep, fn, self._x.deadline())

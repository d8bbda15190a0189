"""This client's NIXL agent (``transport="nixl"``), shared by reads and writes.

The agent is made on first use. A transfer that cannot go over NIXL falls
back to HTTP (``stats["nixl_fallbacks"]``); an endpoint whose daemon has no
NIXL agent is not asked again.
"""

from __future__ import annotations

from kvstore_client.exchange import Endpoint, Exchange
from kvstore_client.nixl import NixlAgent, NixlFallback


class NixlLink:
    def __init__(self, exchange: Exchange, name: str | None, devices: str | None) -> None:
        self._x = exchange
        self.options = (name, devices)
        self._agent: NixlAgent | None = None

    def agent(self) -> NixlAgent:
        if self._agent is None:
            self._agent = NixlAgent(self.options[0], devices=self.options[1])
        return self._agent

    def usable(self, ep: Endpoint) -> bool:
        """Whether a transfer with ``ep`` may try NIXL (its breaker lets it through)."""
        return ep.nixl and ep.breaker.allow()

    def failed(self, ep: Endpoint, e: BaseException) -> None:
        """A transfer with ``ep`` goes over HTTP instead."""
        fallback = e if isinstance(e, NixlFallback) else NixlFallback(f"{type(e).__name__}: {e}")
        self._x.stats["nixl_fallbacks"] += 1
        if fallback.permanent:
            ep.nixl = False
        self._x.log.warning("kvstore NIXL transfer with %s fell back to HTTP: %s", ep.url, fallback)

    async def flush(self) -> None:
        """Release the leases of verified reads still held (before the sessions close)."""
        if self._agent is None:
            return
        for ep in self._x.endpoints.values():
            if ep.session is not None:
                await self._agent.flush(ep.session, ep.url)

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None

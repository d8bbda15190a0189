"""The fleet's tenant registry: one object in the bucket, every node's tenants.

``fleet/registry.json`` is a registry document as a node keeps it (data keys
wrapped under the master key every node of the fleet shares, tokens as
hashes). A node:

- at start-up, before its store opens, takes the fleet's document as its
  own registry (:func:`adopt_at_start`), so it opens with the fleet's tenants;
- every ``s3_refresh_s``, takes the document again if its etag changed
  (:meth:`FleetRegistry.pull`): tenants created, changed, revoked or
  deleted on any node apply here within one refresh;
- makes each admin change (:meth:`FleetRegistry.change`) as a conditional
  write: take the fleet's newest document, apply the change to it, write it
  back with ``If-Match``; if another node's change landed first, take that
  one and apply the change again. Two admin calls racing on two nodes both
  land, one after the other; none is lost.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from kvstore.engine.api import MasterKey, adopt_registry_file
from kvstore.errors import TierConflict, TierError
from kvstore.tier.base import Tier

log = logging.getLogger("kvstore.fleet")

REGISTRY = "fleet/registry.json"
MAX_TRIES = 50
T = TypeVar("T")


async def adopt_at_start(tier: Tier, path: Path, master: MasterKey) -> bool:
    """Before the store opens: make the fleet's registry document this node's
    registry file (checked first: it must be sealed under this node's master
    key). False if the bucket has none yet (this node's becomes the fleet's)."""
    got = await tier.get(REGISTRY)
    if got is None:
        return False
    await asyncio.to_thread(adopt_registry_file, path, got[0], master)
    return True


class FleetRegistry:
    """The store's side: ``document()`` its registry as it is; ``adopt(doc)``
    make ``doc`` its registry (and drop what a deleted tenant left here),
    True if that changed anything."""

    def __init__(
        self,
        tier: Tier,
        document: Callable[[], bytes],
        adopt: Callable[[bytes], Awaitable[bool]],
    ) -> None:
        self.tier = tier
        self._document = document
        self._adopt = adopt
        self._etag: str | None = None  # of the fleet's document this node's registry is (None: not known)
        self._lock = asyncio.Lock()

    async def pull(self) -> bool:
        """Take the fleet's document if it changed since this node last took
        or wrote it; put this node's in the bucket if there is none. True if
        this node's registry changed."""
        got = await self.tier.get(REGISTRY)
        if got is None:
            try:
                self._etag = await self.tier.put_if(REGISTRY, self._document(), None)
                return False
            except TierConflict:
                got = await self.tier.get(REGISTRY)
                if got is None:
                    raise TierError(f"{REGISTRY} appeared and went again") from None
        doc, etag = got
        if etag == self._etag:
            return False
        changed = await self._adopt(doc)
        self._etag = etag
        return changed

    async def sync(self) -> bool:
        """:meth:`pull`, between changes (never in the middle of one)."""
        async with self._lock:
            return await self.pull()

    async def change(self, apply: Callable[[], Awaitable[T]]) -> T:
        """Apply an admin change (``apply``: a change of this node's registry)
        to the fleet's newest document and write it back conditionally; redo
        it on a conflict. On any other failure the change is undone here too
        (the next pull takes the fleet's document again) and the error raised."""
        async with self._lock:
            for attempt in range(MAX_TRIES):
                await self.pull()
                result = await apply()
                try:
                    self._etag = await self.tier.put_if(REGISTRY, self._document(), self._etag)
                    return result
                except TierConflict:
                    log.info("the fleet's registry changed under this node's change; applying it again")
                    await asyncio.sleep(random.uniform(0, 0.01 * (attempt + 1)))
                except BaseException:
                    self._etag = None  # this node's registry holds a change the fleet's does not: take it again
                    raise
            self._etag = None
            raise TierError(f"{REGISTRY}: {MAX_TRIES} conditional writes in a row lost to other nodes' changes")

    async def run(self, interval_s: float) -> None:
        """Pull every ``interval_s`` (the store's ``s3_refresh_s``)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sync()
            except TierError as e:
                log.warning("cannot read the fleet's registry: %s", e)
            except Exception:
                log.exception("taking the fleet's registry failed")

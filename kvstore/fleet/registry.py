"""The fleet's tenant registry: one object in the bucket, every node's tenants.

``fleet/registry.json`` is a registry document as a node keeps it (data keys
wrapped under the master key every node of the fleet shares, tokens as
hashes), with one more field, ``revision``: a number that grows by one with
every change written (absent: 0, as nodes before it wrote the document). A
node:

- at start-up, before its store opens, takes the fleet's document as its
  own registry (:func:`adopt_at_start`), so it opens with the fleet's tenants;
- every heartbeat (:meth:`FleetRegistry.check`, called by
  kvstore/fleet/node.py), asks the object's etag (a HEAD, no body) and takes
  the document when it changed: tenants created, changed, revoked or deleted
  on any node apply here within one heartbeat of the change. Every
  ``s3_refresh_s`` it also pulls on its own (:meth:`FleetRegistry.run`), a
  backstop only;
- makes each admin change (:meth:`FleetRegistry.change`) as a conditional
  write: take the fleet's newest document, apply the change to it, write it
  back with ``If-Match``; if another node's change landed first, take that
  one and apply the change again. Two admin calls racing on two nodes both
  land, one after the other; none is lost.

:attr:`FleetRegistry.confirmed` is when (monotonic) this node last knew its
registry to be the fleet's newest: the start of the last check, pull or
change that succeeded. The node refuses tenant operations once that is too
old (kvstore/fleet/node.py, ``tenants_fenced``), rather than serve tokens
revoked elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from kvstore.engine.api import MasterKey, adopt_registry_file
from kvstore.errors import TierConflict, TierError
from kvstore.metrics import Metrics
from kvstore.tier.base import Tier

log = logging.getLogger("kvstore.fleet")

REGISTRY = "fleet/registry.json"
REVISION = "revision"  # the field of the bucket's document that counts its changes (never in a node's own file)
VERSION_METRIC = "kvstore_fleet_registry_version"
MAX_TRIES = 50
T = TypeVar("T")


def split(data: bytes) -> tuple[bytes, int]:
    """The bucket's document as (the registry document a store keeps, its
    revision). Anything but a JSON object is handed on as it is (revision
    0): the store's check of it says what is wrong."""
    try:
        doc = json.loads(data)
    except ValueError:
        return data, 0
    if not isinstance(doc, dict):
        return data, 0
    revision = doc.pop(REVISION, 0)
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        revision = 0
    # (dumped as the store dumps its registry, kvstore/engine/registry.py: the same bytes back)
    return json.dumps(doc, indent=1, sort_keys=True).encode(), revision


def stamped(document: bytes, revision: int) -> bytes:
    """A store's registry document with ``revision`` added, for the bucket."""
    doc = json.loads(document)
    doc[REVISION] = revision
    return json.dumps(doc, indent=1, sort_keys=True).encode()


async def adopt_at_start(tier: Tier, path: Path, master: MasterKey) -> bool:
    """Before the store opens: make the fleet's registry document this node's
    registry file (checked first: it must be sealed under this node's master
    key). False if the bucket has none yet (this node's becomes the fleet's)."""
    got = await tier.get(REGISTRY)
    if got is None:
        return False
    await asyncio.to_thread(adopt_registry_file, path, split(got[0])[0], master)
    return True


class FleetRegistry:
    """The store's side: ``document()`` its registry as it is; ``adopt(doc)``
    make ``doc`` its registry (and drop what a deleted tenant left here),
    True if that changed anything. ``metrics``: where
    ``kvstore_fleet_registry_version`` (the revision this node holds) is set."""

    def __init__(
        self,
        tier: Tier,
        document: Callable[[], bytes],
        adopt: Callable[[bytes], Awaitable[bool]],
        metrics: Metrics | None = None,
    ) -> None:
        self.tier = tier
        self._document = document
        self._adopt = adopt
        self._metrics = metrics
        self._etag: str | None = None  # of the fleet's document this node's registry is (None: not known)
        self.revision = 0  # the revision of the fleet's document this node's registry is
        self.confirmed = -math.inf  # monotonic: this node's registry was the fleet's newest at or after this
        self._lock = asyncio.Lock()

    def _took(self, etag: str, revision: int, started: float) -> None:
        self._etag = etag
        self._confirm(started)
        self.revision = revision
        if self._metrics is not None:
            self._metrics.set(VERSION_METRIC, revision)

    def _confirm(self, started: float) -> None:
        self.confirmed = max(self.confirmed, started)

    async def pull(self) -> bool:
        """Take the fleet's document if it changed since this node last took
        or wrote it; put this node's in the bucket if there is none. True if
        this node's registry changed."""
        started = time.monotonic()  # what the bucket answers is at least this new
        got = await self.tier.get(REGISTRY)
        if got is None:
            try:
                self._took(await self.tier.put_if(REGISTRY, stamped(self._document(), 1), None), 1, started)
                return False
            except TierConflict:
                got = await self.tier.get(REGISTRY)
                if got is None:
                    raise TierError(f"{REGISTRY} appeared and went again") from None
        data, etag = got
        if etag == self._etag:
            self._confirm(started)
            return False
        doc, revision = split(data)
        changed = await self._adopt(doc)
        self._took(etag, revision, started)
        return changed

    async def sync(self) -> bool:
        """:meth:`pull`, between changes (never in the middle of one)."""
        async with self._lock:
            return await self.pull()

    async def check(self) -> bool:
        """Each heartbeat: the object's etag (a HEAD); the document only if it
        changed (:meth:`sync`). True if this node's registry changed. A
        TierError if the bucket cannot be reached (nothing confirmed then)."""
        started = time.monotonic()
        info = await self.tier.head(REGISTRY)
        if info is not None and info.etag == self._etag:
            self._confirm(started)
            return False
        return await self.sync()

    async def change(self, apply: Callable[[], Awaitable[T]]) -> T:
        """Apply an admin change (``apply``: a change of this node's registry)
        to the fleet's newest document and write it back conditionally; redo
        it on a conflict. On any other failure the change is undone here too
        (the next pull takes the fleet's document again) and the error raised."""
        async with self._lock:
            for attempt in range(MAX_TRIES):
                started = time.monotonic()
                await self.pull()
                result = await apply()
                revision = self.revision + 1
                try:
                    etag = await self.tier.put_if(REGISTRY, stamped(self._document(), revision), self._etag)
                    self._took(etag, revision, started)
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
        """Pull every ``interval_s`` (the store's ``s3_refresh_s``): a
        backstop behind the heartbeat's :meth:`check` (which stops with the
        heartbeat loop, e.g. on a node superseded by another process)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sync()
            except TierError as e:
                log.warning("cannot read the fleet's registry: %s", e)
            except Exception:
                log.exception("taking the fleet's registry failed")

"""A daemon's part in the fleet: join, heartbeat, watch the others, fence.

:class:`FleetNode` runs one loop: every ``heartbeat_s`` it writes its
heartbeat, then observes the membership (declaring silent nodes dead,
rejoining if it was declared dead itself) and tells its listeners when the
view changed (the takeover of a dead node's blocks listens).

**Fencing.** The others declare a node dead ``dead_after_s`` after they last
saw its heartbeat change, and their observation lags by up to a heartbeat.
So a node that has not written a heartbeat for ``dead_after_s -
heartbeat_s`` (a partition, a stopped process, a bucket it cannot reach)
refuses writes, and ``/readyz`` says why, before anyone can have declared it
dead: a partitioned node never serves writes as if it were alone. The check
reads the monotonic clock at each write (it runs on while a process is
stopped), so a process resumed after SIGSTOP refuses writes at once, until
its loop has written a heartbeat and rejoined.

**The tenant registry.** Each heartbeat also checks the fleet's registry
(:meth:`~kvstore.fleet.registry.FleetRegistry.check`: the object's etag, and
the document when it changed), beside the heartbeat and the observation, so
a tenant change made on any node is in force here within one heartbeat (and
the check's time) of its admin call's answer. A node that has not confirmed
its registry for ``dead_after_s - heartbeat_s`` (the write fence's bound:
the bucket, or the node, is away) refuses tenant operations
(:meth:`FleetNode.tenants_fenced`): a token or S3 key revoked on another
node works here at most that long after its revocation answered.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvstore_client.sharding import normalize

from kvstore.errors import Fenced, KVStoreError, NewerFormat, TierError
from kvstore.fleet.membership import Membership, Superseded
from kvstore.fleet.view import ALIVE, FleetView
from kvstore.tasks import Background

if TYPE_CHECKING:
    from kvstore.fleet.registry import FleetRegistry

log = logging.getLogger("kvstore.fleet")

Listener = Callable[[FleetView, FleetView], Awaitable[None]]
CONFIRM_MIN_S = 0.1  # confirm_registry: at most one check this often


class FleetNode:
    def __init__(
        self,
        membership: Membership,
        heartbeat_s: float,
        dead_after_s: float,
        registry: FleetRegistry | None = None,
    ) -> None:
        """``registry``: the fleet's tenant registry, checked every heartbeat
        (None: no tenants to keep in step, as in membership's own tests)."""
        self.membership = membership
        self.registry = registry
        self.node_id = membership.node_id
        self.heartbeat_s = heartbeat_s
        self.fence_after_s = dead_after_s - heartbeat_s
        self.view = FleetView(0, ())
        self.listeners: list[Listener] = []
        self._last_beat = -math.inf  # monotonic: the last heartbeat written
        self._superseded = ""
        self._rejoining = False  # silent past fence_after_s: fenced until a heartbeat and a look at the members
        self._registry_stale = False  # logged as refusing tenant operations: log again when it confirms
        self._registry_error = ""  # the last failure of a registry check logged ("": it succeeded)
        self._tasks = Background()
        self._confirming = asyncio.Lock()  # confirm_registry: one check at a time
        self._confirm_started = -math.inf  # monotonic: when the last of them started

    async def start(self) -> None:
        """Join (a new incarnation), read the members, start the loop."""
        started = time.monotonic()
        await self.membership.join()
        self._last_beat = started
        self.view = await self.membership.observe()
        self._tasks.spawn(self._loop(), "fleet-heartbeat")

    async def close(self) -> None:
        await self._tasks.close()
        await self.membership.close()

    # -- the loop ------------------------------------------------------------------

    async def _loop(self) -> None:
        while not self._superseded:
            await asyncio.sleep(self.heartbeat_s)
            await self.step()

    async def step(self) -> None:
        """One heartbeat and one observation, and beside them one check of
        the fleet's registry (the loop's body)."""
        await asyncio.gather(self._beat_and_observe(), self._check_registry())

    async def _check_registry(self) -> None:
        if self.registry is None:
            return
        try:
            await self.registry.check()
            self._registry_error = ""
        except KVStoreError as e:  # the bucket away; a document it cannot take (a newer release's format)
            if str(e) != self._registry_error:  # (once, not every heartbeat)
                self._registry_error = str(e)
                log.warning("node %s cannot take the fleet's tenant registry: %s", self.node_id, e)
        except Exception:
            log.exception("node %s: taking the fleet's tenant registry failed", self.node_id)
        why = self.tenants_fenced()
        if why and not self._registry_stale:
            self._registry_stale = True
            log.warning("refusing tenant operations: %s", why)
        elif not why and self._registry_stale:
            self._registry_stale = False
            log.warning(
                "node %s confirmed the fleet's tenant registry (revision %d): serving tenants again",
                self.node_id,
                self.registry_version,
            )

    async def _beat_and_observe(self) -> None:
        silent = time.monotonic() - self._last_beat
        if silent > self.fence_after_s and not self._rejoining:
            self._rejoining = True
            log.warning(
                "node %s: no heartbeat written for %.1f s: refusing writes until it has rejoined the fleet",
                self.node_id,
                silent,
            )
        started = time.monotonic()  # the write may land any time after this: count the silence from here
        try:
            await self.membership.heartbeat()
            self._last_beat = started
        except Superseded as e:
            self._supersede(str(e))
            return
        except TierError as e:
            log.warning("fleet heartbeat of node %s failed: %s", self.node_id, e)
        try:
            view = await self.membership.observe()
        except (Superseded, NewerFormat) as e:  # a newer release's members document: not this node's to change
            self._supersede(str(e))
            return
        except TierError as e:
            log.warning("node %s cannot read the fleet's membership: %s", self.node_id, e)
            return
        if self._rejoining and time.monotonic() - self._last_beat <= self.fence_after_s:
            self._rejoining = False
            log.warning("node %s is back in the fleet (incarnation %d)", self.node_id, self.membership.incarnation)
        if view != self.view:
            old, self.view = self.view, view
            for listener in list(self.listeners):
                try:
                    await listener(old, view)
                except Exception:
                    log.exception("a fleet listener failed on the change to version %d", view.version)

    async def remove(self, node_id: str) -> bool:
        """Forget a dead node for good (membership.remove), then look at the
        members at once, so this node's takeover lets go of it."""
        found = await self.membership.remove(node_id)
        if found:
            await self.step()
        return found

    def _supersede(self, why: str) -> None:
        self._superseded = why
        log.error("node %s stops writing: %s", self.node_id, why)

    # -- fencing -------------------------------------------------------------------

    def fenced(self) -> str:
        """Why this node may not write now ("" when it may)."""
        if self._superseded:
            return self._superseded
        silent = time.monotonic() - self._last_beat
        if self._rejoining and silent <= self.fence_after_s:
            return f"node {self.node_id} is rejoining the fleet after a silence"
        if silent > self.fence_after_s:
            return (
                f"node {self.node_id} has not written its heartbeat for {silent:.1f} s "
                f"(more than fleet_dead_after_s - fleet_heartbeat_s = {self.fence_after_s:g} s)"
            )
        me = self.view.member(self.node_id)
        if me is None or me.state != ALIVE:
            return f"node {self.node_id} is not alive in the fleet's membership (yet)"
        return ""

    def fence_at(self) -> float:
        """When (monotonic) this node refuses writes unless a heartbeat lands
        first: its last heartbeat + ``fence_after_s`` (the reader workers
        compute the fence from it, with no lag: kvstore/fleet/shared.py)."""
        return self._last_beat + self.fence_after_s

    def tenants_fence_at(self) -> float:
        """When (monotonic) this node refuses tenant operations unless it
        confirms the fleet's registry first (never, without a registry)."""
        return self.registry.confirmed + self.fence_after_s if self.registry is not None else math.inf

    def check_writable(self) -> None:
        why = self.fenced()
        if why:
            raise Fenced(f"this node refuses writes: {why}")

    # -- placement -----------------------------------------------------------------

    def placed_elsewhere(self, key: str) -> str | None:
        """The URL of the alive member the fleet places ``key`` on when that
        is another node (rendezvous hashing, the client library's function);
        None when it is this node, or when this node sees no placement (no
        member alive, or itself not alive in its view: fenced anyway)."""
        me = self.view.member(self.node_id)
        owner = self.view.owner(key)
        if me is None or me.state != ALIVE or owner is None or owner == normalize(me.url):
            return None
        return owner

    # -- the tenant registry -------------------------------------------------------

    async def confirm_registry(self) -> None:
        """Check the fleet's registry now, for a token this node does not
        know: it may have been issued on another node since the last
        heartbeat's check. Every caller is covered by a check that started
        after it asked; checks run one at a time, at most one every
        :data:`CONFIRM_MIN_S` (a flood of unknown tokens costs the bucket a
        few HEADs a second, never one each). A check that fails leaves
        things as they were (the tenant fence covers a bucket out of reach)."""
        asked = time.monotonic()
        async with self._confirming:
            if self._confirm_started >= asked or self.registry is None:
                return  # a check that started after this call asked has run
            await asyncio.sleep(max(0.0, self._confirm_started + CONFIRM_MIN_S - time.monotonic()))
            self._confirm_started = time.monotonic()
            await self._check_registry()

    @property
    def registry_version(self) -> int:
        """The revision of the fleet's registry this node holds (0: none known)."""
        return self.registry.revision if self.registry is not None else 0

    def tenants_fenced(self) -> str:
        """Why this node may not serve tenant operations now ("" when it may):
        it has not confirmed for ``fence_after_s`` that its registry is the
        fleet's newest, so a token or key revoked on another node might still
        pass here. Reads the clock only (no side effect), like :meth:`fenced`."""
        if self.registry is None:
            return ""
        if self._superseded:
            return f"{self._superseded}; it no longer checks the fleet's tenant registry"
        age = time.monotonic() - self.registry.confirmed
        if age <= self.fence_after_s:
            return ""
        since = "since it started" if math.isinf(age) else f"for {age:.1f} s"
        return (
            f"node {self.node_id} has not confirmed the fleet's tenant registry {since} (more than "
            f"fleet_dead_after_s - fleet_heartbeat_s = {self.fence_after_s:g} s): a token or S3 key changed "
            "on another node might not be in force here"
        )

    def check_tenants(self) -> None:
        """The store's tenant fence (``store.tenant_fence``): :class:`Fenced`
        while :meth:`tenants_fenced` says why."""
        why = self.tenants_fenced()
        if why:
            raise Fenced(f"this node refuses tenant operations: {why}")

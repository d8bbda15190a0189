"""Membership as objects in the bucket, changed only by conditional writes.

Two kinds of objects, under the fleet's prefix:

- ``fleet/members.json``: ``{"format": 1, "version": N, "nodes": {id:
  {"url", "incarnation", "state", "changed_ns"}}}``, the one document every
  node agrees on. ``format`` is the document's layout (absent: 1, as the
  first release wrote it); a node meets a layout it does not know with
  :class:`~kvstore.errors.NewerFormat` and changes nothing (a rolling
  upgrade must not have an older node rewrite what a newer one wrote). A
  join, a rejoin and a death each read it, change it and write it back
  with ``If-Match`` (``If-None-Match: *`` for the first), redoing the change
  on a conflict: two nodes changing it at once both land, in turn, and
  ``version`` grows by one per change.
- ``nodes/ID/heartbeat.json``: written by its node only (under its own
  prefix), every ``fleet_heartbeat_s``, with ``If-Match`` on the etag of its
  own last write: a conflict means another process wrote it, a newer
  incarnation of the same id, and this one is superseded.

A node is declared dead by whichever observer first sees its heartbeat
object unchanged for ``dead_after_s`` of the observer's own clock (etags
compared, never timestamps: no clock needs to agree with another). A node
that comes back and finds itself dead rejoins as a new incarnation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvstore.errors import NewerFormat, NodeAlive, TierConflict, TierError
from kvstore.fleet.membership import Superseded
from kvstore.fleet.view import ALIVE, DEAD, FleetView, Member
from kvstore.tier.base import Tier

log = logging.getLogger("kvstore.fleet")

MEMBERS = "fleet/members.json"
MEMBERS_FORMAT = 1  # the members document's layout, written with every change
MEMBERS_FORMATS_READ = (1,)
MAX_TRIES = 50  # conditional writes of one change before giving up (each conflict means another node's change landed)


def heartbeat_object(node_id: str) -> str:
    return f"nodes/{node_id}/heartbeat.json"


def dump_doc(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def load_doc(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise TierError(f"{what} in the bucket is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise TierError(f"{what} in the bucket is not a JSON object")
    if what == MEMBERS:
        found = doc.get("format", 1)
        if isinstance(found, bool) or found not in MEMBERS_FORMATS_READ:
            if NewerFormat.is_newer(found, MEMBERS_FORMATS_READ):
                raise NewerFormat(
                    f"the fleet's {MEMBERS}", found, MEMBERS_FORMATS_READ, restore=f"the bucket's {MEMBERS}"
                )
            raise TierError(f"{MEMBERS} in the bucket has format {found!r}, which no kvstore writes")
    return doc


class Documents(Protocol):
    """Where shared JSON documents live, changed by conditional writes: a
    tier (the bucket), or etcd (kvstore/fleet/etcd.py)."""

    async def get(self, name: str) -> tuple[bytes, str] | None: ...

    async def put_if(self, name: str, data: bytes, etag: str | None) -> str: ...


async def change_object(
    tier: Documents, name: str, change: Callable[[dict[str, Any] | None], dict[str, Any] | None]
) -> dict[str, Any] | None:
    """Read ``name`` (None if absent), let ``change`` return the new document
    (None: nothing to change), write it back conditionally; on a conflict,
    read again and redo. Returns the document as it is afterwards."""
    for attempt in range(MAX_TRIES):
        got = await tier.get(name)
        doc, etag = (load_doc(got[0], name), got[1]) if got is not None else (None, None)
        new = change(doc)
        if new is None:
            return doc
        if name == MEMBERS:
            new["format"] = MEMBERS_FORMAT
        try:
            await tier.put_if(name, dump_doc(new), etag)
            return new
        except TierConflict:
            await asyncio.sleep(random.uniform(0, 0.01 * (attempt + 1)))  # another node's change landed first
    raise TierError(f"{name}: {MAX_TRIES} conditional writes in a row lost to other nodes' changes")


class BucketMembership:
    """:class:`~kvstore.fleet.membership.Membership` on a tier (the fleet's
    prefix of the bucket). ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(
        self,
        tier: Tier,
        node_id: str,
        url: str,
        dead_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self.node_id = node_id
        self.url = url
        self.dead_after_s = dead_after_s
        self.incarnation = 0
        self._clock = clock
        self._seq = 0
        self._beat_etag: str | None = None
        # Per node: its heartbeat object's etag as last seen, and when (this clock, wall time) it changed.
        self._seen: dict[str, tuple[str | None, float, float]] = {}

    # -- this node ---------------------------------------------------------------

    async def join(self) -> int:
        got = await self.tier.get(heartbeat_object(self.node_id))
        previous = load_doc(got[0], "a heartbeat").get("incarnation", 0) if got is not None else 0
        listed = listed_incarnation(await self.tier.get(MEMBERS), self.node_id)
        self.incarnation = max(int(previous), listed) + 1
        try:
            self._beat_etag = await self.tier.put_if(
                heartbeat_object(self.node_id), self._beat(), got[1] if got is not None else None
            )
        except TierConflict:
            raise Superseded(f"another process is joining the fleet as node {self.node_id!r}") from None
        await self._set_self_alive()
        log.info("joined the fleet as node %s, incarnation %d, at %s", self.node_id, self.incarnation, self.url)
        return self.incarnation

    def _beat(self) -> bytes:
        self._seq += 1
        return dump_doc({"id": self.node_id, "url": self.url, "incarnation": self.incarnation, "seq": self._seq})

    async def heartbeat(self) -> None:
        try:
            self._beat_etag = await self.tier.put_if(heartbeat_object(self.node_id), self._beat(), self._beat_etag)
        except TierConflict:
            raise Superseded(
                f"node {self.node_id!r}'s heartbeat was written by another process (a newer incarnation)"
            ) from None

    async def _set_self_alive(self) -> None:
        await change_object(self.tier, MEMBERS, set_alive(self.node_id, self.incarnation, self.url))

    # -- the others ----------------------------------------------------------------

    async def observe(self) -> FleetView:
        got = await self.tier.get(MEMBERS)
        doc: dict[str, Any] = load_doc(got[0], MEMBERS) if got is not None else {"version": 0, "nodes": {}}
        nodes: dict[str, Any] = doc.get("nodes", {})
        ids = sorted(nodes)
        heads = await asyncio.gather(*(self.tier.head(heartbeat_object(i)) for i in ids))
        now = self._clock()
        for node_id, info in zip(ids, heads, strict=True):
            etag = info.etag if info is not None else None
            seen = self._seen.get(node_id)
            if seen is None or seen[0] != etag:
                self._seen[node_id] = (etag, now, time.time())
        silent = {
            i: int(nodes[i]["incarnation"])
            for i in ids
            if i != self.node_id and nodes[i]["state"] == ALIVE and now - self._seen[i][1] > self.dead_after_s
        }
        mine = nodes.get(self.node_id)
        if mine is not None and self.incarnation and int(mine["incarnation"]) > self.incarnation:
            raise Superseded(f"node {self.node_id!r} joined again as incarnation {mine['incarnation']} elsewhere")
        away = mine is not None and mine["state"] != ALIVE
        if mine is not None and away and self.incarnation:
            # The others declared this node dead while it could not write: a new incarnation.
            self.incarnation = max(self.incarnation, int(mine["incarnation"])) + 1
            await self.heartbeat()
            await self._set_self_alive()
            log.warning("node %s was declared dead; rejoined as incarnation %d", self.node_id, self.incarnation)
        if silent:
            await self._declare_dead(silent)
        if away or silent:
            got = await self.tier.get(MEMBERS)
            doc = load_doc(got[0], MEMBERS) if got is not None else doc
        return self._view(doc)

    async def _declare_dead(self, silent: dict[str, int]) -> None:
        await change_object(self.tier, MEMBERS, declare_dead(silent))
        for i in silent:
            log.warning("node %s: no heartbeat for %.1f s; declared dead", i, self.dead_after_s)

    async def remove(self, node_id: str) -> bool:
        """Forget a dead node (an operator's decommission): out of the
        membership, so nobody serves its blocks any more. False if there is
        no such node; :class:`NodeAlive` if it is alive."""
        found = await remove_member(self.tier, node_id)
        self._seen.pop(node_id, None)
        return found

    async def close(self) -> None:
        """Nothing of its own: the tier is the fleet's (closed with it)."""

    def _view(self, doc: dict[str, Any]) -> FleetView:
        return view_of(doc, {i: seen[2] for i, seen in self._seen.items()})


# -- the members document: changes shared by every membership backend -------------


def listed_incarnation(got: tuple[bytes, str] | None, node_id: str) -> int:
    """``node_id``'s incarnation in the members document ``got`` (0: not listed)."""
    if got is None:
        return 0
    return int(load_doc(got[0], MEMBERS).get("nodes", {}).get(node_id, {}).get("incarnation", 0))


def set_alive(node_id: str, incarnation: int, url: str) -> Callable[[dict[str, Any] | None], dict[str, Any] | None]:
    """The change that lists ``node_id`` alive as ``incarnation`` at ``url``."""

    def change(doc: dict[str, Any] | None) -> dict[str, Any] | None:
        doc = doc or {"version": 0, "nodes": {}}
        entry = doc["nodes"].get(node_id)
        if entry is not None and (entry["state"], entry["incarnation"], entry["url"]) == (ALIVE, incarnation, url):
            return None
        doc["nodes"][node_id] = {"url": url, "incarnation": incarnation, "state": ALIVE, "changed_ns": time.time_ns()}
        doc["version"] = int(doc["version"]) + 1
        return doc

    return change


def declare_dead(silent: dict[str, int]) -> Callable[[dict[str, Any] | None], dict[str, Any] | None]:
    """The change that declares dead each node of ``silent`` (id: the
    incarnation seen silent) still listed alive as that incarnation."""

    def change(doc: dict[str, Any] | None) -> dict[str, Any] | None:
        if doc is None:
            return None
        hit = [
            i
            for i, inc in silent.items()
            if (e := doc["nodes"].get(i)) is not None and e["state"] == ALIVE and int(e["incarnation"]) == inc
        ]
        if not hit:
            return None  # another observer did it, or the node came back as a new incarnation
        for i in hit:
            doc["nodes"][i] = {**doc["nodes"][i], "state": DEAD, "changed_ns": time.time_ns()}
        doc["version"] = int(doc["version"]) + 1
        return doc

    return change


async def remove_member(docs: Documents, node_id: str) -> bool:
    """Take a dead node out of the members document (False: not listed;
    :class:`NodeAlive` if it is alive)."""
    found = False

    def change(doc: dict[str, Any] | None) -> dict[str, Any] | None:
        nonlocal found
        entry = (doc or {}).get("nodes", {}).get(node_id)
        found = entry is not None
        if doc is None or entry is None:
            return None
        if entry["state"] == ALIVE:
            raise NodeAlive(f"node {node_id!r} is alive: stop it (and let the fleet declare it dead) first")
        del doc["nodes"][node_id]
        doc["version"] = int(doc["version"]) + 1
        return doc

    await change_object(docs, MEMBERS, change)
    return found


def view_of(doc: dict[str, Any], last_seen: dict[str, float]) -> FleetView:
    """The members document as a view; ``last_seen``: unix seconds per node."""
    members = []
    for node_id, e in sorted(doc.get("nodes", {}).items()):
        state = ALIVE if e.get("state") == ALIVE else DEAD
        members.append(
            Member(node_id, str(e.get("url", "")), state, int(e.get("incarnation", 0)), last_seen.get(node_id, 0.0))
        )
    return FleetView(int(doc.get("version", 0)), tuple(members))

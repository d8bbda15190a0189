"""A segment's life: its states, the legal transitions, and who makes them.

::

    open --seal--> sealed --upload confirmed--> mirrored --local copy dropped--> remote-only
      ^ appender only         (mirror)                      (evictor)              | rehydrate
                                                                                   v (tiering)
    sealed | mirrored | remote-only --compaction moved every live record--> retired
    retired --no lease left, tier object gone--> deleted          (compactor)
    sealed (ephemeral tenant) --dropped under disk pressure--> deleted   (evictor)
    any --tenant deleted--> deleted                                       (store)

States are recorded durably in the index (``segments``: open/sealed/retired
and the watermarks; ``tiers``: mirrored, remote-only, the object's size), in
the same LMDB transaction as the change they describe, by this module only:
every other module asks it. An illegal transition is a bug and raises
:class:`LifecycleError` before anything is written.

Every transition after which a local segment file must no longer be used
(dropped, retired, deleted, tenant deleted) bumps the index's *epoch*. Reader
processes, which open the same files, poll the epoch (``ReaderSweep``): when
it moves they close their descriptors and mappings of every segment that is
no longer local and alive, so its space comes back. The delay is bounded by
``SWEEP_INTERVAL_S`` plus the longest read in progress on that segment (a read
holds the file open until it ends: unlinking never pulls bytes from under
it, and sealed segments are never truncated).

Writer-side *leases* pin segments for readers that hold bytes outside the
daemon's control (a sendfile or read plan in flight, a NIXL descriptor, an
LMCache lock): compaction, eviction and deletion leave a leased segment's
files in place until the lease is released or expires (:class:`Leases`).
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvstore.engine.index import (
    SEG_OPEN,
    SEG_RETIRED,
    SEG_SEALED,
    TIER_MIRRORED,
    TIER_REMOTE_ONLY,
    Index,
    IndexEntry,
    SegmentState,
    TierState,
)
from kvstore.errors import KVStoreError

SegmentKey = tuple[str, int]
SWEEP_INTERVAL_S = 1.0


class LifecycleError(KVStoreError):
    """A transition the lifecycle does not allow: a bug, never a client's fault."""

    code = "lifecycle_error"


class Phase(enum.Enum):
    """The states of the diagram above, as one value."""

    OPEN = "open"
    SEALED = "sealed"
    MIRRORED = "mirrored"
    REMOTE_ONLY = "remote-only"
    RETIRED = "retired"
    DELETED = "deleted"

    @property
    def local(self) -> bool:
        """Whether a live local file backs this state (reads may open it)."""
        return self in (Phase.OPEN, Phase.SEALED, Phase.MIRRORED)


def phase_of(seg: SegmentState | None, tier: TierState | None) -> Phase:
    if seg is None:
        return Phase.DELETED
    if seg.state == SEG_OPEN:
        return Phase.OPEN
    if seg.state == SEG_RETIRED:
        return Phase.RETIRED
    if tier is not None and not tier.local:
        return Phase.REMOTE_ONLY
    if tier is not None and tier.mirrored:
        return Phase.MIRRORED
    return Phase.SEALED


_LEGAL: dict[str, tuple[set[Phase], Phase]] = {
    "sealed": ({Phase.OPEN}, Phase.SEALED),
    "mirrored": ({Phase.SEALED, Phase.MIRRORED}, Phase.MIRRORED),
    "dropped": ({Phase.MIRRORED}, Phase.REMOTE_ONLY),
    "rehydrated": ({Phase.REMOTE_ONLY}, Phase.MIRRORED),
    "retired": ({Phase.SEALED, Phase.MIRRORED, Phase.REMOTE_ONLY, Phase.RETIRED}, Phase.RETIRED),
}


class Lifecycle:
    """The only writer of segment states. Methods run on executor threads
    (they write LMDB); they are called by the owner of each transition."""

    def __init__(self, index: Index) -> None:
        self._index = index

    def phase(self, tenant: str, sid: int) -> Phase:
        return phase_of(self._index.segment(tenant, sid), self._index.tier_state(tenant, sid))

    def _check(self, tenant: str, sid: int, transition: str) -> tuple[SegmentState, TierState | None]:
        seg, tier = self._index.segment(tenant, sid), self._index.tier_state(tenant, sid)
        allowed, _ = _LEGAL[transition]
        now = phase_of(seg, tier)
        if now not in allowed or seg is None:
            raise LifecycleError(f"segment {tenant}/{sid:016x}: {transition} is not allowed from {now.value}")
        return seg, tier

    # -- the appender's ---------------------------------------------------------

    def opened(self, tenant: str, sid: int, size: int) -> None:
        if self._index.segment(tenant, sid) is not None:
            raise LifecycleError(f"segment {tenant}/{sid:016x} exists already")
        self._index.set_segment_states(tenant, sid, SegmentState(SEG_OPEN, size, size), None)

    def appended(
        self,
        tenant: str,
        sid: int,
        ops: Iterable[tuple[str, IndexEntry | None]],
        size: int,
        synced: int,
        idents: Mapping[str, bytes] | None = None,
    ) -> None:
        """A batch landed in the open segment: its entries (and the engine
        identities of those that have one) and the new watermarks, in one
        transaction (recovery trusts exactly that)."""
        self._index.apply(tenant, ops, sid, SegmentState(SEG_OPEN, size, synced), idents)

    def synced(self, tenant: str, sid: int, size: int) -> None:
        self._index.set_segment_states(tenant, sid, SegmentState(SEG_OPEN, size, size), None)

    def sealed(self, tenant: str, sid: int, records_end: int) -> None:
        self._check(tenant, sid, "sealed")
        self._index.set_segment_states(tenant, sid, SegmentState(SEG_SEALED, records_end, records_end), None)

    # -- the object tier's ------------------------------------------------------

    def mirrored(self, tenant: str, sid: int, size: int) -> bool:
        """The upload is confirmed. False (and nothing written) when the
        segment is no longer one to mirror (retired or deleted meanwhile)."""
        seg, tier = self._index.segment(tenant, sid), self._index.tier_state(tenant, sid)
        if phase_of(seg, tier) not in _LEGAL["mirrored"][0]:
            return False
        self._index.set_segment_states(tenant, sid, None, TierState(TIER_MIRRORED, size, time.time_ns()))
        return True

    def dropped(self, tenant: str, sid: int) -> None:
        """The local copy of a mirrored segment goes: reads go to the tier."""
        _, tier = self._check(tenant, sid, "dropped")
        assert tier is not None
        state = TierState(TIER_MIRRORED | TIER_REMOTE_ONLY, tier.size, tier.mirrored_ns)
        self._index.set_segment_states(tenant, sid, None, state, epoch=True)

    def rehydrated(self, tenant: str, sid: int) -> None:
        _, tier = self._check(tenant, sid, "rehydrated")
        assert tier is not None
        self._index.set_segment_states(tenant, sid, None, TierState(TIER_MIRRORED, tier.size, tier.mirrored_ns))

    # -- compaction, eviction, deletion -----------------------------------------

    def retired(self, tenant: str, sid: int, wait_upto: int = 0) -> None:
        """Compaction moved every live record out: nothing may point here.
        ``wait_upto``: the newest segment holding the copies; an object-tier
        copy of this one goes once every segment up to it is mirrored."""
        seg, _ = self._check(tenant, sid, "retired")
        live = self._index.live(tenant).get(sid)
        if live is not None and live[0] > 0:
            raise LifecycleError(f"segment {tenant}/{sid:016x} still holds {live[0]} live records")
        state = SegmentState(SEG_RETIRED, seg.indexed_upto, seg.synced_upto, max(wait_upto, seg.wait_upto))
        self._index.set_segment_states(tenant, sid, state, None, epoch=True)

    def deleted(self, tenant: str, sid: int) -> None:
        """The segment is gone everywhere (files removed or about to be)."""
        self._index.forget_segment(tenant, sid)

    def tenant_deleted(self, tenant: str) -> None:
        self._index.drop_tenant(tenant)

    # -- recovery's: the repair path at open records what it finds ---------------

    def replayed(
        self, tenant: str, sid: int, ops: Iterable[tuple[str, IndexEntry | None]], sealed: bool, records_end: int
    ) -> None:
        """Entries replayed from a segment's records or footer, with the state
        the segment is found in, in one transaction."""
        state = SegmentState(SEG_SEALED if sealed else SEG_OPEN, records_end, records_end)
        self._index.apply(tenant, ops, sid, state)

    def found_in_tier(self, tenant: str, sid: int, size: int, local: bool) -> None:
        """The object tier holds the segment (``size`` bytes); ``local``:
        a local copy is there too (an eviction cut short, an upload the index
        never heard of), else reads go to the tier."""
        flags = TIER_MIRRORED | (0 if local else TIER_REMOTE_ONLY)
        self._index.set_segment_states(tenant, sid, None, TierState(flags, size, time.time_ns()), epoch=not local)


# -- leases ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lease:
    id: str
    segments: frozenset[SegmentKey]
    expires: float  # time.monotonic()
    #: the tenant that may release it from any connection (a read plan with
    #: paths, a lookup's lock); None: only its holder can (a connection, a task)
    owner: str | None = None
    #: blocks pinned by a lookup's lock (tenant, key): neither evicted for the
    #: tenant's quota nor expired by its TTL while the lease holds
    blocks: frozenset[tuple[str, str]] = frozenset()


class Leases:
    """Pins on segments, each with an expiry; thread-safe. A lease never
    outlives its expiry: expired ones are forgotten on every query."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._claims: set[SegmentKey] = set()
        self._pinning = 0  # leases with blocks: pinned() is free while there are none
        # Held by a pin, and by a removal of blocks from its check of the pins
        # to its commit: a lock's lookup after its pin never finds a block
        # that a removal then takes (see :meth:`sparing`).
        self._pin_guard = threading.Lock()

    def try_claim(self, key: SegmentKey) -> bool:
        """Claim ``key`` for one maintenance task (compaction or eviction), so
        two never work on the same segment; False when taken or leased."""
        with self._lock:
            self._expire()
            if key in self._claims or any(key in lease.segments for lease in self._leases.values()):
                return False
            self._claims.add(key)
            return True

    def unclaim(self, key: SegmentKey) -> None:
        with self._lock:
            self._claims.discard(key)

    def acquire(
        self,
        segments: Iterable[SegmentKey],
        ttl_s: float,
        lease_id: str | None = None,
        owner: str | None = None,
        blocks: Iterable[tuple[str, str]] = (),
    ) -> Lease:
        """A lease on ``segments`` for ``ttl_s`` seconds; ``lease_id``: the id
        a reader worker gave the same lease (the writer holds it for it);
        ``owner``: the tenant that may release it (:meth:`release_owned`);
        ``blocks``: (tenant, key) pinned too (:meth:`pinned`). With blocks it
        waits for a removal in progress (:meth:`sparing`): call it from an
        executor thread then, not the event loop."""
        lease = Lease(
            lease_id or uuid.uuid4().hex, frozenset(segments), time.monotonic() + ttl_s, owner, frozenset(blocks)
        )
        with self._pin_guard if lease.blocks else contextlib.nullcontext(), self._lock:
            self._drop(lease.id)
            self._leases[lease.id] = lease
            self._pinning += bool(lease.blocks)
        return lease

    @contextlib.contextmanager
    def sparing(self, tenant: str, keys: Sequence[str]) -> Iterator[list[str]]:
        """For a removal of blocks of ``tenant`` (quota eviction, TTL sweep):
        the ``keys`` no lease pins, to be removed inside the ``with``. A pin
        taken meanwhile waits for the end of it, so a lock either spares a
        block or (read after its pin) finds it gone, never the two at once."""
        with self._pin_guard:
            pinned = self.pinned(tenant)
            yield [k for k in keys if k not in pinned]

    def _drop(self, lease_id: str) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._pinning -= bool(lease.blocks)
        return lease

    def release(self, lease_id: str) -> bool:
        with self._lock:
            return self._drop(lease_id) is not None

    def is_pinned(self, tenant: str, key: str) -> bool:
        """Whether an unexpired lease pins block ``key`` of ``tenant``."""
        with self._lock:
            if not self._pinning:
                return False
            now = time.monotonic()
            return any(lease.expires > now and (tenant, key) in lease.blocks for lease in self._leases.values())

    def pinned(self, tenant: str) -> frozenset[str]:
        """The keys of ``tenant`` that unexpired leases pin (a lookup's lock)."""
        with self._lock:
            if not self._pinning:
                return frozenset()
            self._expire()
            return frozenset(k for lease in self._leases.values() for t, k in lease.blocks if t == tenant)

    def release_owned(self, lease_id: str, owner: str) -> bool:
        """Release a lease ``owner`` holds and that has not expired; False
        (and nothing released) for any other: unknown, expired, held by a
        connection, or another tenant's."""
        with self._lock:
            self._expire()
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner is None or lease.owner != owner:
                return False
            self._drop(lease_id)
            return True

    def forget_expired(self) -> int:
        """Drop the leases past their expiry (a process that never asks
        :meth:`held` would keep them); returns how many."""
        with self._lock:
            return self._expire()

    def _expire(self) -> int:
        now = time.monotonic()
        gone = [lid for lid, lease in self._leases.items() if lease.expires <= now]
        for lid in gone:
            self._drop(lid)
        return len(gone)

    def held(self, key: SegmentKey) -> bool:
        with self._lock:
            self._expire()
            return any(key in lease.segments for lease in self._leases.values())

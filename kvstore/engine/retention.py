"""Per-tenant quotas and retention (TTL), on the writer.

- **Quota** (``quota_bytes``, 0: none): the bytes a tenant stores across tiers
  (its live records). A put that would take the tenant past its quota first
  makes room by removing the tenant's own least recently used blocks (or,
  with ``quota_eviction = probation``, those not read since they were
  stored first: eviction.py), down to ``QUOTA_LOW`` of the quota (so it
  happens now and then, not on every put); a lower quota set by an admin is
  enforced in the background, down to the quota itself (store_tenants.py);
  no other tenant is ever touched for it. A single block larger than the
  whole quota is refused (``507 quota_exceeded``). Usage counts puts in
  flight, so concurrent puts cannot overshoot by more than what is in flight.
- **TTL** (``ttl_s``, 0: none): a block neither read nor written for that long
  is a miss from then on (store.py checks on every read and lookup); the
  sweeper removes such blocks every ``ttl_sweep_s``.
- **Locks** (a lookup's lease with blocks, lifecycle.Leases): locked blocks
  are neither evicted for the quota nor expired; a put the unlocked blocks
  cannot make room for is refused (``507 quota_exceeded``). A removal checks
  the pins again as it commits (``Leases.sparing``): a lock taken after the
  victims were chosen still wins.

Removals go through the tenant's appender as conditional tombstones
(appender.py ``remove``): a block removed for its quota or TTL is as gone as
a deleted one, after a restart, an index rebuild or a rebuild from the
bucket; its bytes are dead for compaction. A tombstone costs one 4 KiB
record per block removed (bench/README.md has the figures). Access times
come from access.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

from kvstore.config import QUOTA_EVICTION
from kvstore.engine import eviction
from kvstore.engine.access import CHECKPOINT_S, AccessLog, now_ms
from kvstore.engine.appender import Appender
from kvstore.engine.eviction import Candidate, Choice, Probation
from kvstore.engine.index import ON_PROBATION, READ_AGAIN, Index, IndexEntry
from kvstore.engine.lifecycle import Leases
from kvstore.engine.registry import Registry, Tenant
from kvstore.errors import KVStoreError, QuotaExceeded
from kvstore.events.model import BlockMeta
from kvstore.metrics import Metrics

log = logging.getLogger("kvstore.engine.retention")
QUOTA_LOW = 0.99  # a put past the quota makes room down to this share of it
PAGE = 4096
DROP_CHUNK = 1024


Removed = Callable[[str, str, Sequence[tuple[str, IndexEntry]], Mapping[str, BlockMeta]], None]


STATE_SAVE_S = 60.0  # how often the eviction states changed are kept in the index while the node runs


def _state_gauges(name: str) -> list[tuple[str, dict[str, str]]]:
    """The gauges of a tenant's eviction state, with their labels."""
    return [
        ("kvstore_tenant_eviction_share", {"tenant": name}),
        ("kvstore_tenant_eviction_ghosts", {"tenant": name, "list": "probation"}),
        ("kvstore_tenant_eviction_ghosts", {"tenant": name, "list": "reused"}),
    ]


def last_access(entry: IndexEntry, checkpointed: int, in_memory: int) -> int:
    """Unix milliseconds of a block's last read or write."""
    return max(entry.created_ns // 1_000_000, checkpointed, in_memory)


class Retention:
    def __init__(
        self,
        index: Index,
        registry: Registry,
        access: AccessLog,
        appender: Callable[[str], Appender],
        run: Callable[..., Awaitable[Any]],
        metrics: Metrics,
        removed: Removed | None = None,
        identities: Callable[[str, Sequence[str]], Mapping[str, BlockMeta]] | None = None,
        leases: Leases | None = None,
        eviction: str = "lru",  # quota_eviction, checked by the config: "lru" or "probation"
    ) -> None:
        # Blocks a lookup's lock pins (leases): never removed here while pinned.
        self._leases = leases or Leases()
        # For the residency events: blocks gone (tenant, cause, entries, identities),
        # and the identities of blocks about to go (read before they do).
        self._removed = removed
        self._identities = identities
        self._index = index
        self._registry = registry
        self._access = access
        self._appender = appender
        self._run = run
        self._metrics = metrics
        self._inflight: dict[str, int] = defaultdict(int)
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._checkpoint_lock = asyncio.Lock()
        self._eviction = eviction
        # tenant -> its state under probation (eviction.py), as the index kept
        # it at the last stop; those changed since saved, and when that was.
        self._probation: dict[str, Probation] = self._learned()
        self._unsaved: set[str] = set()
        self._saved_at = time.monotonic()
        self._watching: set[str] = set()  # tenants whose new blocks the index keeps for probation's ghosts
        # Before victims are picked: the other workers' reads handed over (kvstore/touchbells.py).
        self.gather_touches: Callable[[], Awaitable[None]] | None = None

    # -- access times -----------------------------------------------------------

    async def checkpoint(self) -> int:
        """Write the touches held in memory to the index; returns how many."""
        async with self._checkpoint_lock:
            touches = self._access.drain()
            n = 0
            for tenant, keys in touches.items():
                if tenant in self._registry:
                    await self._run(self._index.record_access, tenant, list(keys.items()))
                    n += len(keys)
            return n

    async def checkpointer(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_S)
            try:
                await self.checkpoint()
                if time.monotonic() - self._saved_at >= STATE_SAVE_S:
                    await self.save_states()
            except KVStoreError as e:  # a full disk: those access times are lost, nothing else
                log.warning("checkpoint of access times failed: %s", e)
            except Exception:
                log.exception("checkpoint of access times failed")

    def expired(self, t: Tenant, key: str, entry: IndexEntry, now: int | None = None) -> bool:
        """Whether ``entry`` of tenant ``t`` is past its TTL (an LMDB read; no write)."""
        if not t.ttl_s or self._leases.is_pinned(t.name, key):
            return False
        checkpointed = self._index.accessed(t.name, [key])[0]
        last = last_access(entry, checkpointed, self._access.last(t.name, key))
        return (now_ms() if now is None else now) - last > t.ttl_s * 1000

    # -- quotas -----------------------------------------------------------------

    def check_block(self, t: Tenant, size: int) -> None:
        if t.quota_bytes and size > t.quota_bytes:
            raise QuotaExceeded(
                f"the block is {size} bytes; tenant {t.name!r} has a quota of {t.quota_bytes} bytes in all"
            )

    @contextlib.asynccontextmanager
    async def reserve(self, t: Tenant, nbytes: int) -> Any:
        """Room for a record of ``nbytes`` within the tenant's quota, held
        while it is written (evicting the tenant's LRU blocks if needed)."""
        used = self._index.stats(t.name).stored_bytes + self._inflight[t.name] if t.quota_bytes else 0
        if t.quota_bytes and used + nbytes > t.quota_bytes:
            await self.enforce(t, nbytes)
            # Puts in flight may overshoot for a moment (the quota is soft for
            # them, as without locks); what is stored may not pass the quota
            # because locks hold the rest.
            if self._leases.pinned(t.name) and self._index.stats(t.name).stored_bytes + nbytes > t.quota_bytes:
                raise QuotaExceeded(
                    f"tenant {t.name!r} is at its quota of {t.quota_bytes} bytes and the rest is held by "
                    "leases (blocks locked by lookups): retry once they are released"
                )
        self._inflight[t.name] += nbytes
        try:
            yield
        finally:
            self._inflight[t.name] -= nbytes
            if not self._inflight[t.name]:
                del self._inflight[t.name]

    async def enforce(self, t: Tenant, incoming: int = 0, low: float | None = None) -> int:
        """Bring the tenant under its quota with room for ``incoming`` bytes,
        down to ``low`` of the quota (None: ``QUOTA_LOW``), by the tenant's
        eviction policy;
        returns the bytes removed. Under ``lru`` it walks the index's access
        order from the oldest block and removes at most ``DROP_CHUNK`` blocks
        a step (the tenant's lock held for a step, not the whole of it), so
        its cost and memory follow what goes, not what stays."""
        if not t.quota_bytes:
            return 0
        used = self._index.stats(t.name).stored_bytes + self._inflight[t.name]
        if used + incoming <= t.quota_bytes:
            return 0
        if self.gather_touches is not None:
            await self.gather_touches()  # reads served by reader workers a moment ago count
        await self.checkpoint()  # the order sees the latest reads
        freed = 0
        after: tuple[int, str] | None = None
        while True:
            async with self._locks[t.name]:
                held = time.perf_counter()
                if t.name not in self._registry:
                    break
                t = self._registry.get(t.name)  # the quota as it is now (an admin may change it meanwhile)
                if not t.quota_bytes:
                    break
                policy = self.policy(t)
                target = int(t.quota_bytes * (QUOTA_LOW if low is None else low)) - incoming
                need = self._index.stats(t.name).stored_bytes + self._inflight[t.name] - target
                if need <= 0:
                    break
                if policy == "lru":
                    if t.name in self._watching:  # no longer under probation
                        self._watching.discard(t.name)
                        self._index.unwatch_arrivals(t.name)
                    victims, after = await self._run(self._lru_step, t.name, need, after)
                    choice = Choice(victims)
                else:  # probation: walks that cost what goes (_victims), removed in steps
                    choice = await self._run(self._victims, t, need)
                gone = await self._remove(t.name, [(c.key, c.entry) for c in choice.victims], "quota")
                if policy != "lru":
                    self._remember(t, choice)
                self._metrics.inc("kvstore_quota_evictions_total", len(choice.victims))
                self._metrics.inc("kvstore_quota_evicted_bytes_total", gone)
                # how long the step held the tenant's lock (its puts wait that long)
                self._metrics.observe("kvstore_quota_eviction_step_seconds", time.perf_counter() - held, policy=policy)
                freed += gone
                if not choice.victims or policy != "lru":
                    break
            await asyncio.sleep(0)  # a step done: puts, reads and other tenants go on
        return freed

    def _lru_step(
        self,
        tenant: str,
        need: int,
        after: tuple[int, str] | None,
        limit: int | None = None,
        kind: bytes | None = None,
    ) -> tuple[list[Candidate], tuple[int, str] | None]:
        """The least recently used unpinned blocks adding up to ``need``
        bytes (at most ``limit``; only those of ``kind`` if given), walking
        the index's access order from just after ``after``; and where the
        walk stopped. A block read since the last checkpoint (its touch
        still in memory) is newer than its place in the order says: it is
        passed over."""
        pinned = self._leases.pinned(tenant)
        limit = DROP_CHUNK if limit is None else limit
        stats = self._index.stats(tenant)
        mean = max(1, stats.stored_bytes // max(1, stats.blocks))
        size = min(PAGE, need // mean + 16)  # about the blocks that make ``need``; doubled while short
        out: list[Candidate] = []
        got = 0
        while got < need and len(out) < limit:
            page = self._index.oldest(tenant, after, size, kind=kind)
            size = min(PAGE, size * 2)
            if not page:
                break
            for ms, key, entry in page:
                after = (ms, key)
                if key in pinned or self._access.last(tenant, key) > ms:
                    continue
                created = entry.created_ns // 1_000_000
                out.append(Candidate(key, entry, created, 0 if kind == ON_PROBATION else ms))
                got += entry.record_len
                if got >= need or len(out) >= limit:
                    break
        return out, after

    def _stored_since(self, tenant: str) -> Iterator[Candidate]:
        """The tenant's blocks on probation (not pinned) stored since the
        last look: the ghosts that may have come back. The index keeps the
        new blocks of a tenant it watches; the first look (and one after
        more than MAX_ARRIVALS new blocks) walks every block on probation."""
        pinned = self._leases.pinned(tenant)
        if tenant not in self._watching:
            self._index.watch_arrivals(tenant)  # before the walk: what is indexed after it is kept
            self._watching.add(tenant)
            arrived = None
        else:
            arrived = self._index.arrivals(tenant)
        if arrived is None:
            yield from self._lru_step(tenant, 1 << 62, None, 1 << 62, ON_PROBATION)[0]
            return
        for i in range(0, len(arrived), PAGE):
            chunk = [(k, e) for k, e in arrived[i : i + PAGE] if k not in pinned]
            times = self._index.accessed(tenant, [k for k, _ in chunk])
            for (key, entry), accessed in zip(chunk, times, strict=True):
                c = Candidate(key, entry, entry.created_ns // 1_000_000, accessed)
                if not eviction.read_since_stored(c) and self._index.get(tenant, key) == entry:
                    yield Candidate(key, entry, c.created_ms, 0)  # still there, and not read since stored

    def _victims(self, t: Tenant, need: int) -> Choice:
        """The blocks to remove for ``need`` bytes, as the tenant's eviction
        says (eviction.py). Under ``probation``, the choice
        ``eviction.probation`` makes from every block, made from walks that
        cost what goes: the blocks stored since the last eviction are
        checked against the ghosts (those that came back count as read from
        now on, in the index), then the blocks on probation are walked from
        the oldest for what their bytes beyond the newest share of the quota
        give, then the blocks read since stored from the least recently used
        for the rest."""
        name = t.name
        if self.policy(t) == "lru":
            return Choice(self._lru_step(name, need, None, limit=1 << 62)[0])
        state = self._probation_of(t)
        returns = eviction.Returns(state, t.quota_bytes)
        for c in self._stored_since(name):
            returns.check(c)
        if returns.new:  # read from now on: out of the blocks on probation
            self._index.record_access(name, [(c.key, c.created_ms) for c in returns.new])
        keep_new = int(t.quota_bytes * returns.share)
        # Puts in flight (not indexed yet) are the newest blocks on probation:
        # they take the share's room first.
        fresh = self._index.fresh_bytes(name) + self._inflight.get(name, 0)
        on_probation = min(need, max(0, fresh - keep_new))
        first = self._lru_step(name, on_probation, None, 1 << 62, ON_PROBATION)[0] if on_probation > 0 else []
        rest = need - sum(c.size for c in first)
        then = self._lru_step(name, rest, None, 1 << 62, READ_AGAIN)[0] if rest > 0 else []
        return Choice(
            first + then,
            [c.key for c in first],
            [c.key for c in then],
            self._index.stats(name).blocks,
            returns.new,
            returns.reused,
            returns.share,
        )

    def policy(self, t: Tenant) -> str:
        """The eviction of ``t``'s quota: its own (``eviction``), else the
        node's ``quota_eviction`` (as for a value this release does not
        know), but ``lru`` for a tenant with admission (``admit_after`` > 1),
        which does not compose with ``probation`` (store_tenants.py)."""
        if t.eviction in QUOTA_EVICTION:
            return t.eviction
        return "lru" if t.admit_after > 1 else self._eviction

    def _probation_of(self, t: Tenant) -> Probation:
        state = self._probation.get(t.name)
        if state is None or state.incarnation != t.created_ns:  # a tenant deleted and created again starts over
            state = self._probation[t.name] = Probation(t.created_ns)
        return state

    def forget_tenant(self, name: str) -> None:
        """A deleted tenant's state under ``probation`` (its ghosts: up to a
        million keys) goes with it (the index drops its copy with the tenant)."""
        self._probation.pop(name, None)
        self._unsaved.discard(name)
        self._watching.discard(name)
        self._index.unwatch_arrivals(name)
        for gauge, labels in _state_gauges(name):
            self._metrics.unset(gauge, **labels)

    def _learned(self) -> dict[str, Probation]:
        """The states the index kept (none on a reader's read-only index)."""
        out = {}
        for name, raw in self._index.policy_states().items():
            state = Probation.decode(raw)
            if state is None:
                log.warning("tenant %s's eviction state is in a form this release does not read: it starts over", name)
                continue
            out[name] = state
            self._show(name, state)
        return out

    def _show(self, name: str, state: Probation) -> None:
        (share, _), (new, _), (reused, _) = _state_gauges(name)
        self._metrics.set(share, state.share, tenant=name)
        self._metrics.set(new, len(state.evicted_new), tenant=name, list="probation")
        self._metrics.set(reused, len(state.evicted_reused), tenant=name, list="reused")

    async def save_states(self) -> None:
        """Keep the states changed since the last save in the index (at a
        clean stop, and every ``STATE_SAVE_S`` while they change)."""
        self._saved_at = time.monotonic()
        names, self._unsaved = self._unsaved, set()
        states = {n: self._probation[n] for n in names if n in self._probation}
        if states:
            await self._run(lambda: self._index.save_policy_states({n: s.encode() for n, s in states.items()}))

    def _remember(self, t: Tenant, choice: Choice) -> None:
        """What an eviction under ``probation`` learnt: its ghosts, the ghosts
        that came back (those on probation reused for good: an access time
        says so once the ghost is forgotten), and the share they moved."""
        state = self._probation_of(t)
        for c in choice.returned_new:
            self._access.touch(t.name, c.key, c.created_ms)
        state.evicted_new.forget(c.key for c in choice.returned_new)
        state.evicted_reused.forget(choice.returned_reused)
        state.share = choice.share
        bound = min(choice.held, eviction.GHOST_KEYS)
        now = now_ms()
        state.evicted_new.add(choice.on_probation, now, bound)
        state.evicted_reused.add(choice.after_reads, now, bound)
        self._unsaved.add(t.name)
        self._show(t.name, state)

    async def _remove(self, tenant: str, victims: list[tuple[str, IndexEntry]], cause: str) -> int:
        freed = 0
        app = self._appender(tenant)
        for i in range(0, len(victims), DROP_CHUNK):
            chunk = victims[i : i + DROP_CHUNK]
            metas = self._identities(tenant, [k for k, _ in chunk]) if self._identities is not None else {}
            gone = set(await app.remove(chunk, functools.partial(self._leases.sparing, tenant)))
            freed += sum(e.record_len for k, e in chunk if k in gone)
            if self._removed is not None:
                self._removed(tenant, cause, [(k, e) for k, e in chunk if k in gone], metas)
        return freed

    # -- TTL ------------------------------------------------------------------------

    async def sweeper(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("TTL sweep failed")

    async def sweep(self, tenant: str | None = None) -> int:
        """Remove the blocks past their tenant's TTL; returns how many. Each
        tenant's blocks are walked in the index's access order from the
        oldest, up to the first one still within its TTL: the cost follows
        what expires, not what stays."""
        removed = 0
        for name in [tenant] if tenant is not None else self._registry.names():
            if name not in self._registry or not self._registry.get(name).ttl_s:
                continue
            await self.checkpoint()
            t = self._registry.get(name)
            cutoff = now_ms() - t.ttl_s * 1000
            after: tuple[int, str] | None = None
            try:
                while True:
                    page = await self._run(self._index.oldest, name, after, DROP_CHUNK, cutoff)
                    if not page:
                        break
                    after = (page[-1][0], page[-1][1])
                    pinned = self._leases.pinned(name)
                    victims = [
                        (key, entry)
                        for ms, key, entry in page
                        if key not in pinned and self._access.last(name, key) < cutoff
                    ]
                    removed += len(victims)
                    await self._remove(name, victims, "expired")
            except KVStoreError as e:  # the tenant went meanwhile
                log.info("TTL sweep of %s stopped: %s", name, e)
        self._metrics.inc("kvstore_expired_total", removed)
        return removed

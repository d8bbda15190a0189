"""The event bus: numbers events, keeps a bounded backlog, and hands each to
its subscribers' bounded queues. ``publish`` never blocks and never fails
the write that caused it: a subscriber that falls behind loses events and
is told so (a gap), the store carries on. Event-loop only."""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.events.model import BlockMeta, Event, Kind, TierName
from kvstore.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Gap:
    """Events ``first`` to ``last`` (inclusive) are lost to this subscriber:
    gone from the backlog, or dropped because it fell behind."""

    first: int
    last: int


class Subscription:
    """One subscriber's queue: events of ``tenant`` (None: every tenant)."""

    def __init__(self, bus: EventBus, tenant: str | None, limit: int) -> None:
        self._bus = bus
        self.tenant = tenant
        self._limit = limit
        self._queue: deque[Event | Gap] = deque()
        self._wake = asyncio.Event()
        self._lost: Gap | None = None  # dropped since the queue was last drained
        self.dropped = 0
        self.ended = False  # the daemon is stopping: no more events for this subscriber

    def offer(self, ev: Event) -> None:
        if self.tenant is not None and ev.tenant != self.tenant:
            return
        if self._lost is not None or len(self._queue) >= self._limit:
            first = self._lost.first if self._lost is not None else ev.seq
            self._lost = Gap(first, ev.seq)
            self.dropped += 1
            self._bus.dropped(1)
            self._wake.set()
            return
        self._queue.append(ev)
        self._wake.set()

    def put_gap(self, gap: Gap) -> None:
        self._queue.append(gap)
        self._wake.set()

    def drain(self) -> list[Event | Gap]:
        """What is queued now, without waiting."""
        out = list(self._queue)
        self._queue.clear()
        if self._lost is not None:
            out.append(self._lost)
            self._lost = None
        self._wake.clear()
        return out

    def end(self) -> None:
        """Wake the subscriber for good (the daemon stops)."""
        self.ended = True
        self._wake.set()

    async def next_batch(self, timeout: float | None = None) -> list[Event | Gap]:
        """Everything queued, waiting up to ``timeout`` for something."""
        if not self._queue and self._lost is None and not self.ended:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return []
        return self.drain()

    def close(self) -> None:
        self._bus.unsubscribe(self)


class EventBus:
    def __init__(self, backlog: int, queue_limit: int, metrics: Metrics) -> None:
        self.epoch = f"{time.time_ns():x}-{os.getpid()}"  # this run's numbering
        self._next = 0
        self._backlog: deque[Event] = deque(maxlen=max(backlog, 1))
        self._subs: set[Subscription] = set()
        self._queue_limit = queue_limit
        self._metrics = metrics

    @property
    def next_seq(self) -> int:
        return self._next

    def publish(
        self,
        tenant: str,
        kind: Kind,
        cause: str,
        tier: TierName | None = None,
        keys: Sequence[str] = (),
        sizes: Sequence[int] = (),
        metas: Sequence[BlockMeta] | None = None,
        topic: str = "",
    ) -> Event:
        ks = tuple(keys)
        ev = Event(
            self._next,
            time.time(),
            tenant,
            kind,
            cause,
            tier,
            ks,
            tuple(sizes),
            tuple(metas) if metas is not None else tuple(BlockMeta.of_key(k) for k in ks),
            topic,
        )
        self._next += 1
        self._backlog.append(ev)
        self._metrics.inc("kvstore_events_total", kind=kind)
        for sub in list(self._subs):
            sub.offer(ev)
        return ev

    def subscribe(self, tenant: str | None = None, since: int | None = None) -> Subscription:
        """A subscription to events from now on, or from ``since`` (the
        backlog's events from there first; a gap when some are gone)."""
        sub = Subscription(self, tenant, self._queue_limit)
        if since is not None and since < self._next:
            gap, kept = self.backlog_since(since)
            if gap is not None:
                sub.put_gap(gap)
            for ev in kept:
                sub.offer(ev)
        self._subs.add(sub)
        self._metrics.set("kvstore_event_subscribers", len(self._subs))
        return sub

    def end(self) -> None:
        """The daemon stops: every subscriber is woken and told so."""
        for sub in list(self._subs):
            sub.end()

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)
        self._metrics.set("kvstore_event_subscribers", len(self._subs))

    def dropped(self, n: int) -> None:
        self._metrics.inc("kvstore_events_dropped_total", n)

    def backlog_since(self, since: int) -> tuple[Gap | None, list[Event]]:
        """The backlog from ``since`` on, and the gap before it if some are gone."""
        oldest = self._backlog[0].seq if self._backlog else self._next
        gap = Gap(max(since, 0), oldest - 1) if since < oldest else None
        return gap, [ev for ev in self._backlog if ev.seq >= since]

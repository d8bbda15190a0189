"""Admission: which new blocks a tenant stores.

A tenant with ``admit_after`` N > 1 stores a block it does not hold only at
the N-th time the block is offered (put) within ``admit_window_s`` of its
first offer; the earlier offers are answered "not admitted" and write
nothing. Dynamo KVBM's offload frequency filter and vLLM's offloading
connector gate their stores the same way: most blocks of a real workload
are used once (a prompt's unshared tail), and a block never read again is
only SSD wear and space taken from blocks that would be. The price is a
miss at the reuses that come before the N-th offer.

The offers are counted in the memory of the process that writes (reader
workers relay every write to the writer, and the fast lane takes PUTs on
the writer only), per tenant, in a table of at most ``admission_keys``
keys: the key's hash (Python's, SipHash seeded per process, so a tenant
cannot aim collisions) -> its first offer's time and its count, in the
order of first offers. An offer ``admit_window_s`` or more after the first
starts the count again; when the table is full the key tracked longest is
forgotten (counted in :attr:`Offers.forgotten`), so a workload that offers
more new keys per window than the table holds gets a shorter window. The
counts are not persisted: a restart starts them again, which only delays
admissions. A stored block's entry is dropped (a put of a key that exists
is not an offer: it is answered as stored); a block admitted but whose
write then fails keeps its count, so the next offer is admitted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.errors import NotAdmitted
from kvstore.metrics import Metrics
from kvstore.names import GATEWAY_PREFIXES

if TYPE_CHECKING:
    from kvstore.engine.registry import Tenant

MAX_ADMIT_AFTER = 16
MAX_ADMIT_WINDOW_S = 7 * 86_400
DEFAULT_ADMIT_WINDOW_S = 3_600
_COUNT_BITS = 5  # counts up to 31 > MAX_ADMIT_AFTER; the rest of the value: the first offer, in ms
_COUNT = (1 << _COUNT_BITS) - 1


class Offers:
    """Offers of keys not stored yet, per tenant, in bounded tables (see
    the module's doc). On the event loop only: no lock."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        """``capacity``: the keys tracked per tenant; ``clock``: seconds,
        monotonic (injectable for tests)."""
        if capacity < 1:
            raise ValueError(f"capacity must be 1 or more; got {capacity}")
        self._capacity = capacity
        self._clock = clock
        self._epoch = clock()
        self._tables: dict[str, OrderedDict[int, int]] = {}
        self.forgotten = 0  # keys dropped for room before their window ended

    def _now_ms(self) -> int:
        return int((self._clock() - self._epoch) * 1000)

    def offer(self, tenant: str, key: str, window_s: int) -> int:
        """Count one offer of ``tenant``'s ``key``: how many offers of it
        fall within ``window_s`` of its first, this one included."""
        now = self._now_ms()
        window = window_s * 1000
        table = self._tables.get(tenant)
        if table is None:
            table = self._tables[tenant] = OrderedDict()
        while table:  # the oldest first offers, past the window: gone (amortized O(1))
            oldest, first = next(iter(table.items()))
            if now - (first >> _COUNT_BITS) < window:
                break
            del table[oldest]
        h = hash(key)
        packed = table.get(h)
        if packed is None:
            if len(table) >= self._capacity:
                table.popitem(last=False)
                self.forgotten += 1
            table[h] = now << _COUNT_BITS | 1
            return 1
        count = min((packed & _COUNT) + 1, _COUNT)
        table[h] = packed & ~_COUNT | count  # its place stays: the order is of first offers
        return count

    def stored(self, tenant: str, key: str) -> None:
        """``key`` is stored now: its offers need no counting."""
        table = self._tables.get(tenant)
        if table is not None:
            table.pop(hash(key), None)
            if not table:
                del self._tables[tenant]

    def forget_tenant(self, tenant: str) -> None:
        """Drop ``tenant``'s counts (deleted, or it admits every block now)."""
        self._tables.pop(tenant, None)

    def tracked(self, tenant: str) -> int:
        """How many of ``tenant``'s keys have offers counted now."""
        table = self._tables.get(tenant)
        return len(table) if table is not None else 0


class Admission:
    """The admission decision, asked by every write path of the store (a
    put, a write plan) once it knows the block is new, and told when such
    a block is stored. Counts, per tenant: ``kvstore_tenant_admission_total``
    and ``kvstore_tenant_admission_bytes_total`` with ``result`` declined
    (offers answered not admitted: what was not written) or admitted (blocks
    stored at their ``admit_after``-th offer), and
    ``kvstore_tenant_admission_forgotten_total`` (keys forgotten for room)."""

    def __init__(self, capacity: int, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.offers = Offers(capacity, clock)
        self._metrics = metrics

    def check(self, t: Tenant, key: str, size: int) -> bool:
        """Count this offer of ``t``'s new block ``key`` (``size`` bytes) if
        ``t`` stores blocks only at their ``admit_after``-th offer; raise
        NotAdmitted before that one. True when it was counted: the caller
        then tells :meth:`stored` once the block is. The S3 gateway's blocks
        are always stored: an object missing a piece would be damaged, and
        S3 has no answer for "not stored"."""
        if t.admit_after <= 1 or key.startswith(GATEWAY_PREFIXES):
            return False
        forgotten = self.offers.forgotten
        offers = self.offers.offer(t.name, key, t.admit_window_s)
        if self.offers.forgotten != forgotten:  # its table was full (admission_keys)
            self._metrics.inc("kvstore_tenant_admission_forgotten_total", tenant=t.name)
        if offers < t.admit_after:
            self._count(t.name, "declined", size)
            raise NotAdmitted(key, offers, t.admit_after, t.admit_window_s)
        return True

    def stored(self, t: Tenant, key: str, size: int) -> None:
        """A block :meth:`check` counted is stored: its offers are no longer tracked."""
        self.offers.stored(t.name, key)
        self._count(t.name, "admitted", size)

    def _count(self, tenant: str, result: str, size: int) -> None:
        self._metrics.inc("kvstore_tenant_admission_total", tenant=tenant, result=result)
        self._metrics.inc("kvstore_tenant_admission_bytes_total", size, tenant=tenant, result=result)

    def forget_tenant(self, tenant: str) -> None:
        """Drop ``tenant``'s counts (deleted, or it stores every block now)."""
        self.offers.forget_tenant(tenant)

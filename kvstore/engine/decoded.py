"""The decoded-blocks cache: sealed and compressed blocks that are read often
do not pay the codec (AES-GCM, zstd) on every read.

A sealed GET costs the daemon several times a direct one: every read opens
and decompresses its frames again. This cache keeps the plaintext of blocks
decoded recently, in this process's memory only (never written to disk: no
file, no swap-out by design beyond what the OS does to any process memory),
bounded by ``decoded_cache_bytes`` per worker process (0 turns it off),
least recently read evicted first.

- **Keyed by record**: (tenant, the tenant's incarnation and current data-key
  version, record id). A record id names one write's bytes, so compaction and
  rehydration (which move records, not change them) keep the entry valid,
  and a block written again is another record (a miss).
- **Per tenant**: the bytes each tenant holds are counted (``/metrics``:
  ``kvstore_decoded_cache_bytes{tenant}``); no tenant holds more than
  ``TENANT_SHARE`` of the cache, so one tenant's scan cannot flush everyone
  else's hot blocks. A tenant's entries are dropped when it is deleted or its
  data key rotates (this process at once; another worker at its first read
  of that tenant after the change, which its key no longer matches).
- **Only through the index**: an entry is found only with a record id read
  from the tenant's own index entry, so it answers exactly the reads a
  decode would have answered.
- A block is kept whole; a ranged read of a block not yet cached decodes the
  whole block once (then the ranges are slices of it).

Hits, misses and evictions: ``kvstore_decoded_cache_{hits,misses,evictions}_total``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvstore.metrics import Metrics

TENANT_SHARE = 0.5  # the most of the cache one tenant may hold (with more than one tenant in it)

Generation = tuple[int, int]  # (the tenant's created_ns, its current data key version)


class DecodedCache:
    """Plaintext of whole blocks by (tenant, record id); thread-safe."""

    def __init__(self, capacity: int, metrics: Metrics) -> None:
        self.capacity = capacity
        self._metrics = metrics
        self._lock = threading.Lock()
        # The buffers are never handed out: readers get read-only views or copies.
        self._blocks: OrderedDict[tuple[str, bytes], bytes | bytearray | memoryview] = OrderedDict()
        self._held: dict[str, int] = {}  # bytes per tenant
        self._generation: dict[str, Generation] = {}
        self._reported: set[str] = set()  # tenants the last gauges() named
        self.size = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def get(
        self, tenant: str, generation: Generation, record_id: bytes, count_miss: bool = True
    ) -> bytes | bytearray | memoryview | None:
        """The block's plaintext, if cached under the tenant's current
        generation. ``count_miss`` False: a look whose miss the read that
        follows counts (the fast lane's, before the route's)."""
        with self._lock:
            if self._generation.get(tenant, generation) != generation:
                self._drop_locked(tenant)
            data = self._blocks.get((tenant, record_id))
            if data is not None:
                self._blocks.move_to_end((tenant, record_id))
        if data is None:
            if count_miss:
                self._metrics.inc("kvstore_decoded_cache_misses_total")
        else:
            self._metrics.inc("kvstore_decoded_cache_hits_total")
        return data

    def put(self, tenant: str, generation: Generation, record_id: bytes, data: bytes | bytearray | memoryview) -> None:
        """Keep ``data`` (immutable: shared by every read of it), evicting the
        least recently read blocks (the tenant's own first once it is over its share)."""
        n = len(data)
        if n > self.capacity * TENANT_SHARE:
            return
        with self._lock:
            if self._generation.get(tenant, generation) != generation:
                self._drop_locked(tenant)
            self._generation[tenant] = generation
            key = (tenant, record_id)
            if key in self._blocks:
                return
            while self._held.get(tenant, 0) + n > self.capacity * TENANT_SHARE and self._held.get(tenant, 0):
                self._evict_locked(own=tenant)
            while self.size + n > self.capacity and self._blocks:
                self._evict_locked()
            self._blocks[key] = data
            self._held[tenant] = self._held.get(tenant, 0) + n
            self.size += n

    def drop_tenant(self, tenant: str) -> None:
        """Forget every block of ``tenant`` (deleted, or its key rotated)."""
        with self._lock:
            self._drop_locked(tenant)

    def held(self) -> dict[str, int]:
        """Bytes cached per tenant."""
        with self._lock:
            return dict(self._held)

    def gauges(self) -> dict[str, int]:
        """:meth:`held`, with 0 for the tenants the last call reported that
        hold nothing now (so a gauge of a dropped tenant goes to 0)."""
        with self._lock:
            now = dict(self._held)
            gone, self._reported = self._reported - now.keys(), set(now)
        return {**dict.fromkeys(gone, 0), **now}

    def _drop_locked(self, tenant: str) -> None:
        for key in [k for k in self._blocks if k[0] == tenant]:
            self.size -= len(self._blocks.pop(key))
        self._held.pop(tenant, None)
        self._generation.pop(tenant, None)

    def _evict_locked(self, own: str | None = None) -> None:
        if own is None:
            (tenant, _), data = self._blocks.popitem(last=False)
        else:
            key = next(k for k in self._blocks if k[0] == own)
            tenant, data = own, self._blocks.pop(key)
        self.size -= len(data)
        left = self._held[tenant] - len(data)
        if left:
            self._held[tenant] = left
        else:
            del self._held[tenant]
        self._metrics.inc("kvstore_decoded_cache_evictions_total")

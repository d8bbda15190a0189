"""When each block was last read or written, tracked cheaply.

A read costs one dict store on the event loop (no LMDB write transaction per
read). The writer checkpoints what changed to the index every
``CHECKPOINT_S`` in one transaction (and at close); reader processes hand
their touches to the writer about every second (the internal route in
transport/http/internal.py). After a crash or restart, access times are at most that
old, so a restart never makes the hottest data look cold: the quota's LRU and
the TTL see every access but the last few seconds'.

Times are milliseconds since the epoch; a block never accessed since it was
written counts from its record's ``created_ns``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

Touches = dict[str, dict[str, int]]  # tenant -> key -> unix milliseconds
CHECKPOINT_S = 5.0
MAX_PENDING = 1_000_000  # touches held before an early checkpoint


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class AccessLog:
    """Touches since the last checkpoint; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, int]] = defaultdict(dict)
        self._count = 0

    def touch(self, tenant: str, key: str, when: int | None = None) -> None:
        t = now_ms() if when is None else when
        with self._lock:
            keys = self._pending[tenant]
            if key not in keys:
                self._count += 1
            if keys.get(key, 0) < t:
                keys[key] = t

    def merge(self, touches: Touches) -> None:
        """Touches reported by another process."""
        for tenant, keys in touches.items():
            for key, t in keys.items():
                self.touch(tenant, key, t)

    def last(self, tenant: str, key: str) -> int:
        """The last touch held in memory (0: none since the last checkpoint)."""
        with self._lock:
            keys = self._pending.get(tenant)
            return keys.get(key, 0) if keys else 0

    def drain(self) -> Touches:
        """Everything touched since the last drain (and forget it)."""
        with self._lock:
            out, self._pending, self._count = dict(self._pending), defaultdict(dict), 0
        return out

    def forget_tenant(self, tenant: str) -> None:
        with self._lock:
            keys = self._pending.pop(tenant, None)
            self._count -= len(keys or ())

    @property
    def full(self) -> bool:
        return self._count >= MAX_PENDING

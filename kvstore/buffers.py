"""Page-aligned memory, pooled: what O_DIRECT writes need, and what request
bodies are received into so that the write takes them without a copy.

An :class:`AlignedBuffer` is an anonymous mapping (page-aligned by
construction). Touching fresh pages costs page faults, so buffers are kept
for reuse by capacity class (:class:`BufferPool`), up to a bound.
"""

from __future__ import annotations

import contextlib
import mmap
import threading

import numpy as np


def address(view: memoryview) -> int:
    """The memory address of ``view``'s first byte (read-only views too)."""
    addr: int = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
    return addr


class AlignedBuffer:
    """Page-aligned memory of ``capacity`` bytes (an anonymous mapping), from
    a :class:`BufferPool`; ``view`` is its first ``size`` bytes."""

    __slots__ = ("_map", "capacity", "pool", "size")

    def __init__(self, capacity: int, pool: BufferPool | None = None) -> None:
        self._map = mmap.mmap(-1, capacity)
        self.capacity = capacity
        self.size = 0
        self.pool = pool

    @property
    def memory(self) -> memoryview:
        """All ``capacity`` bytes, writable."""
        return memoryview(self._map)

    @property
    def view(self) -> memoryview:
        return memoryview(self._map)[: self.size]

    def unmap(self) -> None:
        """Unmap now, unless a view of it is still alive (then with the last one)."""
        with contextlib.suppress(BufferError):
            self._map.close()

    def release(self) -> None:
        """Give the buffer back to its pool; no view of it may be used after."""
        if self.pool is not None:
            self.pool.give_back(self)


class BufferPool:
    """Aligned buffers kept for reuse, by capacity class (powers of two from
    64 KiB): memory touched once, so reusing it costs no page faults. At most
    ``keep_bytes`` of idle buffers are kept; the rest are unmapped."""

    MIN_CLASS = 64 << 10

    def __init__(self, keep_bytes: int = 256 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._idle: dict[int, list[AlignedBuffer]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def capacity_for(cls, n: int) -> int:
        cap = cls.MIN_CLASS
        while cap < n:
            cap <<= 1
        return cap

    def take(self, size: int) -> AlignedBuffer:
        """A buffer of at least ``size`` bytes, its ``size`` set."""
        cap = self.capacity_for(size)
        with self._lock:
            free = self._idle.get(cap)
            buf = free.pop() if free else None
            if buf is not None:
                self._idle_bytes -= cap
        if buf is None:
            buf = AlignedBuffer(cap, self)
        buf.size = size
        return buf

    def give_back(self, buf: AlignedBuffer) -> None:
        with self._lock:
            if self._idle_bytes + buf.capacity <= self.keep_bytes:
                self._idle.setdefault(buf.capacity, []).append(buf)
                self._idle_bytes += buf.capacity
                return
        buf.unmap()

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes


POOL = BufferPool()  # the process's: bodies received for puts, staging of direct writes

"""Node-wide token buckets: every worker's view of a tenant's limits.

A tenant's limit is the node's, not each worker's, so the buckets live in one
small table in shared memory (:func:`shared_table`: a memfd the supervisor
makes before it forks, which every worker maps), one slot per
tenant that has a limit or has moved bytes: a digest of its name, then per
kind (read bytes, written bytes, requests) a bucket's tokens and stamp, and a
count of what was served (from which the writer derives each tenant's
current rates). The table is memory, never a file in the data directory:
its pages are the kernel's, not the disk's, so a full disk cannot take a
worker down through them (a write to an unallocated page of a mapped file on
a full filesystem is SIGBUS, which killed the writer of a full tmpfs), and
there is nothing to reset at start-up (the rates are momentary). A change
takes the table's ``fcntl`` lock (a process that dies
holding it loses it), so a reservation is atomic across workers. Stamps are
``CLOCK_MONOTONIC``, one clock for every process of a boot; a stamp from
another boot (later than now) reads as a full bucket. Every stamp is read
from the table's ``clock`` (``time.monotonic`` unless a test gives another),
so the arithmetic can be checked without waiting on real time.

A bucket holds :data:`BURST_S` of its rate. A reservation takes its tokens
at once, going into debt if there are too few, and is told how long to wait
for the debt to be paid; later reservations queue behind it. A reservation
that would wait longer than it may takes nothing (its caller answers
``429``). A reservation larger than the bucket passes when the bucket is
full (a block larger than half a second of the limit can still be read); the
debt it leaves holds the long-run rate. Over a window of ``T`` seconds a
tenant moves at most ``rate * (T + BURST_S)`` plus one request.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

log = logging.getLogger("kvstore.qos")

Kind = Literal["read", "write", "request"]
KINDS: tuple[Kind, ...] = ("read", "write", "request")
_INDEX = {k: i for i, k in enumerate(KINDS)}
BURST_S = 0.5  # a bucket holds this much of its rate
SLOTS = 4096
_SLOT = struct.Struct("<16s3d3d3Q")  # name digest; tokens, stamps, served counts per kind
_SLOT_SIZE = 96
_HEADER = 64
_MAGIC = b"kvstore qos rates v1\n"
_EMPTY = bytes(16)
_SIZE = _HEADER + SLOTS * _SLOT_SIZE
assert _SLOT.size <= _SLOT_SIZE


def _burst(rate: float) -> float:
    """What a bucket of ``rate`` per second holds: BURST_S of it, one at least."""
    return max(rate * BURST_S, 1.0)


def _digest(tenant: str) -> bytes:
    return hashlib.blake2b(tenant.encode(), digest_size=16, person=b"kvstore-qos").digest()


def shared_table() -> int:
    """A new, empty table for the workers of one daemon: the file descriptor
    of a memfd of the table's size, inherited by the processes forked after
    this (each maps it with ``RateTable(fd)``); close-on-exec, so no program
    a worker runs holds it."""
    fd = os.memfd_create("kvstore-qos-rates", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, _SIZE)
        os.pwrite(fd, _MAGIC, 0)
    except OSError:
        os.close(fd)
        raise
    return fd


class RateTable:
    """The buckets, in the table every worker maps (``fd``: from
    :func:`shared_table`), or in this process's memory (``fd`` None: one
    worker, nothing to share). ``clock`` gives every stamp, in seconds; the
    workers sharing a table must share its clock (``CLOCK_MONOTONIC`` is one
    clock for every process of a boot)."""

    def __init__(self, fd: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._fd = -1
        if fd is None:
            self._map = mmap.mmap(-1, _SIZE)
        else:
            if os.fstat(fd).st_size != _SIZE or os.pread(fd, len(_MAGIC), 0) != _MAGIC:
                raise ValueError(f"fd {fd} is not a QoS table made by shared_table()")
            self._fd = os.dup(fd)  # this table's own: close() leaves the caller's
            self._map = mmap.mmap(self._fd, _SIZE)
        self._where: dict[str, int] = {}  # tenant -> its slot's offset, as last found

    def close(self) -> None:
        self._map.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if self._fd < 0:
            yield
            return
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def _slot(self, tenant: str) -> int:
        """The offset of ``tenant``'s slot (the lock held), made if it has none.
        A full table starts over empty: every bucket full again, counts from
        zero (4096 tenants with limits on one node is not a case served)."""
        digest = _digest(tenant)
        off = self._where.get(tenant)
        if off is not None and self._map[off : off + 16] == digest:
            return off
        start = int.from_bytes(digest[:4], "little") % SLOTS
        for i in range(SLOTS):
            off = _HEADER + ((start + i) % SLOTS) * _SLOT_SIZE
            held = self._map[off : off + 16]
            if held == digest:
                break
            if held == _EMPTY:
                self._map[off : off + _SLOT.size] = _SLOT.pack(digest, -1.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0, 0, 0)
                break
        else:
            log.warning("qos: the rate table has no free slot: starting it over")
            self._map[_HEADER:] = bytes(len(self._map) - _HEADER)
            self._where.clear()
            return self._slot(tenant)
        self._where[tenant] = off
        return off

    def take(self, tenant: str, kind: Kind, n: float, rate: float, max_wait_s: float) -> float:
        """Reserve ``n`` of ``tenant``'s ``kind`` at ``rate`` per second: the
        seconds to wait before going on (0: now), or, when that would be over
        ``max_wait_s``, minus the seconds after which a retry may pass, and
        nothing is taken."""
        i = _INDEX[kind]
        burst = _burst(rate)
        with self._locked():
            off = self._slot(tenant)
            fields = list(_SLOT.unpack_from(self._map, off))
            tokens, stamp, now = float(fields[1 + i]), float(fields[4 + i]), self._clock()
            if (tokens < 0 and stamp < 0) or stamp > now:  # new, or a stamp of another boot
                tokens, stamp = burst, now
            tokens = min(burst, tokens + (now - stamp) * rate)
            wait = max(0.0, (min(n, burst) - tokens) / rate)
            if wait > max_wait_s:
                fields[1 + i], fields[4 + i] = tokens, now
                _SLOT.pack_into(self._map, off, *fields)
                return -wait
            fields[1 + i], fields[4 + i] = tokens - n, now
            _SLOT.pack_into(self._map, off, *fields)
        return wait

    def give_back(self, tenant: str, kind: Kind, n: float, rate: float) -> None:
        """Return ``n`` taken but not used (a request that ended before moving them)."""
        i = _INDEX[kind]
        with self._locked():
            off = self._slot(tenant)
            fields = list(_SLOT.unpack_from(self._map, off))
            fields[1 + i] = min(_burst(rate), fields[1 + i] + n)
            _SLOT.pack_into(self._map, off, *fields)

    def add_served(self, served: dict[str, tuple[int, int, int]]) -> None:
        """Add what this worker served since its last call (tenant -> bytes
        read, bytes written, requests) to the node's counts."""
        with self._locked():
            for tenant, counts in served.items():
                off = self._slot(tenant)
                fields = list(_SLOT.unpack_from(self._map, off))
                for i, c in enumerate(counts):
                    fields[7 + i] = (fields[7 + i] + c) & 0xFFFF_FFFF_FFFF_FFFF
                _SLOT.pack_into(self._map, off, *fields)

    def served(self, tenants: list[str]) -> dict[str, tuple[int, int, int]]:
        """The node's counts of ``tenants`` (bytes read, bytes written, requests) since the table began."""
        out = {}
        with self._locked():
            for tenant in tenants:
                off = self._slot(tenant)
                f = _SLOT.unpack_from(self._map, off)
                out[tenant] = (f[7], f[8], f[9])
        return out

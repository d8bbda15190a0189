"""Memory the daemon's NIXL agent exposes to its peers.

Three kinds of region, each registered once with the agent:

- a segment's mapping (read-only, shared): direct blocks are READ straight
  from it. One per segment file (a new one when an open segment grew past
  it), kept while the segment has its local file or a lease holds it;
- a tenant's staging chunk (anonymous, ``CHUNK`` bytes or one block's size):
  where sealed blocks are decoded for readers, blocks in the object tier
  only are copied, and clients' writes land. Pieces are allocated per lease
  and freed when it ends; a chunk serves one tenant only and goes when it
  has been empty for ``IDLE_S``. All chunks together stay within a budget;
- a write plan's landing (writable, shared): the room a write plan reserved
  for one block in its segment, where the daemon READs the client's block
  straight into the file's pages (no staging, no put). It exists for one
  transfer: no peer is ever sent its metadata, so it is let go at once.

A peer is sent the metadata of its own tenant's regions only.

Why regions are mapped by hand (libc mmap) and retired in three steps: UCX
over TCP checks no memory keys on the serving side, so a peer that READs
after its lease ended (it kept stale metadata) makes the daemon's progress
thread copy from whatever is at that address; an unmapped address kills the
daemon (measured: SIGSEGV). So a retired region is deregistered at once,
stays mapped ``GRACE_S`` (a late READ gets the old bytes, which fail the
frames' checksums the client verifies, or which the release call tells it
to discard), is then replaced in place by zero pages (its file or memory is
let go; a late READ gets zeros, discarded the same way) and only unmapped
``UNMAP_S`` later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore_client.wire.nixl_loader import nixl_api

from kvstore.errors import BodyTooLarge, Overloaded, StorageIOError

GRACE_S = 30.0  # a retired region keeps its bytes this long
UNMAP_S = 3600.0  # and its (zero) pages this long
CHUNK = 64 << 20  # staging memory is mapped per tenant in chunks of this size (or one block's)
IDLE_S = 10.0  # an empty staging chunk is retired after this long
ALIGN = 4096
FileKey = tuple[str, int, int]  # tenant, incarnation, segment id: names one segment file

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000


def _mmap(addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int = 0) -> int:
    got = _libc.mmap(addr, length, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise StorageIOError(f"mmap of {length} bytes failed: {os.strerror(err)}")
    return int(got)


def view(addr: int, length: int) -> memoryview:
    """The bytes at ``addr`` (a region's), without a copy."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def _round(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


@dataclass(eq=False)
class Region:
    id: int
    tenant: str
    addr: int
    length: int
    reg: Any  # the agent's registration (nixlRegDList)
    file: FileKey | None = None  # a segment's mapping; None: a staging chunk
    holders: set[str] = field(default_factory=set)  # leases using it
    free: list[tuple[int, int]] = field(default_factory=list)  # staging: free (offset, length), sorted
    idle_since: float = 0.0


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a staging chunk, for one use."""

    region: Region
    offset: int
    length: int

    @property
    def addr(self) -> int:
        return self.region.addr + self.offset

    def view(self, n: int | None = None) -> memoryview:
        return view(self.addr, self.length if n is None else n)


class Memory:
    """The registered regions of one agent. Event-loop only (not thread-safe)."""

    def __init__(self, agent: Any, budget: int, grace_s: float = GRACE_S, unmap_s: float = UNMAP_S) -> None:
        self._agent = agent
        self.budget = budget
        self._grace_s = grace_s
        self._unmap_s = unmap_s
        self._ids = itertools.count(1)
        self._segments: dict[FileKey, Region] = {}
        self._outgrown: list[Region] = []  # mappings an open segment grew past, still held
        self._chunks: dict[str, list[Region]] = {}  # tenant -> its staging chunks
        self.mapped_staging = 0
        self._retired: list[tuple[float, int, int]] = []  # (when to blank, addr, length)
        self._blanked: list[tuple[float, int, int]] = []  # (when to unmap, addr, length)

    # -- segment mappings -------------------------------------------------------

    def segment(self, tenant: str, file: FileKey, fd: int, end: int) -> Region:
        """The registered mapping of segment ``file`` (open as ``fd``) that
        covers its first ``end`` bytes."""
        r = self._segments.get(file)
        if r is not None and r.length >= end:
            return r
        size = os.fstat(fd).st_size
        if size < end:
            raise StorageIOError(f"segment {file} is {size} bytes; a block ends at {end}")
        addr = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd)
        region = self._register(tenant, addr, size, file)
        if r is not None:  # an open segment grew: leases keep the old mapping until they end
            if r.holders:
                self._outgrown.append(r)
            else:
                self._retire(r)
        self._segments[file] = region
        return region

    # -- write landings ---------------------------------------------------------

    def landing(self, tenant: str, fd: int, offset: int, length: int) -> Region:
        """``length`` bytes of the file open as ``fd`` (read-write) from
        ``offset`` (both page multiples), mapped shared and registered."""
        addr = _mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, offset)
        return self._register(tenant, addr, length, None)

    def drop_landing(self, region: Region) -> None:
        """Deregister and unmap a landing once its transfer ended (its bytes
        stay in the file's pages)."""
        self._agent.deregister_memory(region.reg)
        _libc.munmap(region.addr, region.length)

    # -- staging ----------------------------------------------------------------

    def stage(self, tenant: str, size: int) -> Piece:
        """``size`` bytes of ``tenant``'s staging memory (``Overloaded`` while
        the budget is taken)."""
        need = _round(size)
        if need > self.budget:
            raise BodyTooLarge(f"{size} bytes do not fit nixl_staging_bytes ({self.budget}); transfer fewer blocks")
        for chunk in self._chunks.get(tenant, []):
            piece = self._take(chunk, need)
            if piece is not None:
                return piece
        length = max(need, min(CHUNK, self.budget))
        if self.mapped_staging + length > self.budget:
            self._drop_idle(0.0)
            if self.mapped_staging + length > self.budget:
                length = need
            if self.mapped_staging + length > self.budget:
                raise Overloaded(
                    f"the NIXL staging memory is taken ({self.mapped_staging} of {self.budget} bytes); retry"
                )
        addr = _mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
        chunk = self._register(tenant, addr, length, None)
        chunk.free = [(0, length)]
        self._chunks.setdefault(tenant, []).append(chunk)
        self.mapped_staging += length
        piece = self._take(chunk, need)
        assert piece is not None
        return piece

    def free(self, piece: Piece) -> None:
        chunk = piece.region
        spans = sorted([*chunk.free, (piece.offset, piece.length)])
        merged: list[tuple[int, int]] = []
        for off, n in spans:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        chunk.free = merged
        if merged == [(0, chunk.length)]:
            chunk.idle_since = time.monotonic()

    def _take(self, chunk: Region, need: int) -> Piece | None:
        for i, (off, n) in enumerate(chunk.free):
            if n >= need:
                chunk.free[i : i + 1] = [(off + need, n - need)] if n > need else []
                return Piece(chunk, off, need)
        return None

    def _drop_idle(self, idle_s: float) -> None:
        now = time.monotonic()
        for tenant, chunks in list(self._chunks.items()):
            for chunk in [c for c in chunks if c.free == [(0, c.length)] and now - c.idle_since >= idle_s]:
                chunks.remove(chunk)
                self.mapped_staging -= chunk.length
                self._retire(chunk)
            if not chunks:
                del self._chunks[tenant]

    # -- leases, upkeep ---------------------------------------------------------

    def hold(self, region: Region, lease: str) -> None:
        region.holders.add(lease)

    def let_go(self, region: Region, lease: str) -> None:
        region.holders.discard(lease)
        if not region.holders and region in self._outgrown:
            self._outgrown.remove(region)
            self._retire(region)

    def sweep(self, alive: Callable[[FileKey], bool]) -> None:
        """Retire the mappings of segments that lost their local file
        (compacted, dropped, deleted) and that no lease holds, and staging
        chunks empty for ``IDLE_S``; move retired regions along."""
        for file, r in list(self._segments.items()):
            if not r.holders and not alive(file):
                del self._segments[file]
                self._retire(r)
        self._drop_idle(IDLE_S)
        now = time.monotonic()
        while self._retired and self._retired[0][0] <= now:
            _, addr, length = self._retired.pop(0)
            # Zero pages in place, atomically: the file (or memory) is let go, the address stays valid.
            _mmap(addr, length, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1)
            self._blanked.append((now + self._unmap_s, addr, length))
        while self._blanked and self._blanked[0][0] <= now:
            _, addr, length = self._blanked.pop(0)
            _libc.munmap(addr, length)

    def metadata(self, regions: list[Region]) -> bytes:
        """Partial metadata of the agent for ``regions``, with its connection info."""
        if regions:
            descs = self._agent.get_reg_descs([(r.addr, r.length, 0, "") for r in regions], "DRAM")
        else:  # connection info only (the wrapper cannot build an empty list)
            bind = nixl_api().nixlBind
            descs = bind.nixlRegDList(bind.DRAM_SEG)
        return bytes(self._agent.get_partial_agent_metadata(descs, True))

    def stats(self) -> dict[str, int]:
        return {
            "segment_regions": len(self._segments) + len(self._outgrown),
            "staging_chunks": sum(len(c) for c in self._chunks.values()),
            "staging_bytes": self.mapped_staging,
            "staging_in_use": sum(c.length - sum(n for _, n in c.free) for cs in self._chunks.values() for c in cs),
            "staging_budget": self.budget,
            "retired_regions": len(self._retired) + len(self._blanked),
        }

    def close(self) -> None:
        """Deregister and unmap everything (the agent is going away)."""
        regions = [*self._segments.values(), *self._outgrown, *(c for cs in self._chunks.values() for c in cs)]
        for r in regions:
            self._agent.deregister_memory(r.reg)
            _libc.munmap(r.addr, r.length)
        for _, addr, length in [*self._retired, *self._blanked]:
            _libc.munmap(addr, length)
        self._segments.clear()
        self._outgrown.clear()
        self._chunks.clear()
        self._retired.clear()
        self._blanked.clear()
        self.mapped_staging = 0

    def _register(self, tenant: str, addr: int, length: int, file: FileKey | None) -> Region:
        try:
            reg = self._agent.register_memory([(addr, length, 0, "")], "DRAM")
        except BaseException:
            _libc.munmap(addr, length)
            raise
        return Region(next(self._ids), tenant, addr, length, reg, file)

    def _retire(self, region: Region) -> None:
        self._agent.deregister_memory(region.reg)
        self._retired.append((time.monotonic() + self._grace_s, region.addr, region.length))

"""What a fleet node's writer worker tells its reader workers.

With several workers, one process (the writer) runs the node's part in the
fleet: membership, heartbeats, fencing, the registry's version, takeovers of
dead nodes. The readers serve reads from the same files and relay the rest,
but three of their own answers depend on the writer's state: ``/readyz``
(a fenced node is not ready), tenant operations (refused while the node
cannot confirm the fleet's registry), and reads of blocks a dead node left
(only the writer holds the stores it took over: while it holds any, the
readers relay block reads to it).

The writer publishes that state (:class:`FleetState`, every heartbeat and at
each change) into a page of shared memory the supervisor makes before it
forks (:func:`shared_state`, a memfd like the QoS table: memory, never a file
in the data directory); each reader reads it (:class:`FleetFollower`) at most
every :data:`READ_EVERY_S`. A state older than its ``stale_after_s`` (the
writer stopped publishing: stuck, or gone and about to be replaced) reads
as fenced for writes and for tenant operations.

A record is ``<u32 length><u32 crc32>`` then that many bytes of JSON; a
reader that finds a record mid-write (its checksum fails) reads again.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvstore.errors import Fenced

SIZE = 4096
_HEAD = struct.Struct("<II")
READ_EVERY_S = 0.1  # a reader's view of the writer's state is at most this old (plus the writer's period)
_MAX_REASON = 1000


@dataclass(frozen=True, slots=True)
class FleetState:
    """The writer's fleet state: why it refuses writes ("" if it does not),
    why it refuses tenant operations, how many dead nodes' blocks it serves,
    the registry version it has, and when (``CLOCK_MONOTONIC``, one clock for
    every process of a boot). ``fence_at`` and ``tenants_fence_at``: when
    the writer's fences go up by themselves (time passing without a
    heartbeat, without a confirmed registry), so a reader sees them at the
    same moment, not a publication later."""

    fenced: str = ""
    tenants_fenced: str = ""
    takeovers: int = 0
    registry_version: int = 0
    stamp: float = 0.0
    fence_at: float = math.inf  # when the writer refuses writes unless a heartbeat lands first
    tenants_fence_at: float = math.inf  # when it refuses tenant operations unless it confirms the registry


def shared_state() -> int:
    """A new page for one daemon's workers: a memfd, inherited by the
    processes forked after this, close-on-exec."""
    fd = os.memfd_create("kvstore-fleet-state", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, SIZE)
    except OSError:
        os.close(fd)
        raise
    return fd


def publish(fd: int, state: FleetState) -> None:
    """Write ``state`` (the writer's)."""
    doc = asdict(state)
    doc["fenced"] = state.fenced[:_MAX_REASON]
    doc["tenants_fenced"] = state.tenants_fenced[:_MAX_REASON]
    body = json.dumps(doc).encode()
    os.pwrite(fd, _HEAD.pack(len(body), zlib.crc32(body)) + body, 0)


def read(fd: int) -> FleetState | None:
    """The state last published; None if none was yet (or it cannot be read whole)."""
    for _ in range(3):
        raw = os.pread(fd, SIZE, 0)
        length, crc = _HEAD.unpack_from(raw)
        if length == 0:
            return None
        body = raw[_HEAD.size : _HEAD.size + length]
        if length <= SIZE - _HEAD.size and zlib.crc32(body) == crc:
            return FleetState(**json.loads(body))
    return None


class FleetFollower:
    """A reader worker's view of its writer's fleet state (``fd``: from
    :func:`shared_state`). Past ``stale_after_s`` without a new state, the
    node reads as fenced: the writer is stuck or gone."""

    def __init__(self, fd: int, stale_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._fd = os.dup(fd)  # this follower's own: close() leaves the caller's
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._state: FleetState | None = None
        self._read_at = -1e18

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def state(self) -> FleetState | None:
        now = self._clock()
        if now - self._read_at >= READ_EVERY_S and self._fd >= 0:
            self._state, self._read_at = read(self._fd), now
        return self._state

    def _stale(self) -> str:
        state = self.state()
        if state is None:
            return "the writer worker has not published the node's fleet state yet"
        age = self._clock() - state.stamp
        if age > self.stale_after_s:
            return f"the writer worker has not published the node's fleet state for {age:.1f} s"
        return ""

    def _fence(self, tenants: bool) -> str:
        """Why a fence is up: the writer stale, the reason it published, or
        the fence's deadline passed since ("" when it is down)."""
        state, stale = self.state(), self._stale()
        if state is None or stale:
            return stale
        why, due, what = (
            (state.tenants_fenced, state.tenants_fence_at, "its confirmation of the fleet's tenant registry")
            if tenants
            else (state.fenced, state.fence_at, "its heartbeat")
        )
        late = self._clock() - due
        return why or (f"{what} is {late:.1f} s past due (the writer worker's fence)" if late > 0 else "")

    def fenced(self) -> str:
        """Why the node refuses writes ("" when it does not)."""
        return self._fence(tenants=False)

    def tenants_fenced(self) -> str:
        """Why the node refuses tenant operations ("" when it does not)."""
        return self._fence(tenants=True)

    def check_tenants(self) -> None:
        """The store's tenant fence on a reader worker: Fenced while the writer's is."""
        why = self.tenants_fenced()
        if why:
            raise Fenced(f"this node refuses tenant operations: {why}")

    def takeovers(self) -> int:
        """How many dead nodes' blocks the writer serves now."""
        state = self.state()
        return state.takeovers if state is not None else 0

"""The read-path interface: one way to read blocks into the caller's buffers.

A :class:`Reader` is handed the keys still to read and serves what it can:
for each key it serves, an :data:`Outcome` (the block's size, ``None`` for
absent, or the error that ends that key's read); the keys it leaves go to the
next reader (:class:`kvstore_client.reads.path.ReadPath` holds the order).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from kvstore_client.decoding import Decode, DecodePool
from kvstore_client.errors import BufferTooSmall
from kvstore_client.exchange import Exchange
from kvstore_client.plans import Plan, PlannedBlock
from kvstore_client.sharding import Shards

#: a key's read: its size, None (absent), or the error that ends its read
Outcome = int | None | BaseException
#: what a reader served (index -> outcome) and the indices it left
Served = tuple[dict[int, Outcome], list[int]]
T = TypeVar("T")


class Left(enum.Enum):
    """A key a reader does not serve: left for the next one."""

    LEFT = enum.auto()


LEFT = Left.LEFT


class Reader(Protocol):
    async def read(self, keys: Sequence[str], bufs: Sequence[memoryview], todo: list[int]) -> Served:
        """Try to read ``keys[i]`` into ``bufs[i]`` for each ``i`` in ``todo``:
        what it served and the indices left for the next reader."""
        ...


async def each(todo: list[int], read: Callable[[int], Awaitable[T]]) -> dict[int, T | BaseException]:
    """``read(i)`` for every index at once; an exception is that key's outcome."""
    if len(todo) == 1:  # get_into: no task to make
        try:
            return {todo[0]: await read(todo[0])}
        except Exception as e:  # noqa: BLE001 - the key's outcome: the caller raises it, as gather would return it
            return {todo[0]: e}
    results = await asyncio.gather(*(read(i) for i in todo), return_exceptions=True)
    return dict(zip(todo, results, strict=True))


def too_small(key: str, size: int, mv: memoryview) -> BufferTooSmall:
    return BufferTooSmall(f"block {key} is {size} bytes; the buffer holds {mv.nbytes}")


def planned(plan: Plan, key: str, mv: memoryview, decode: Decode) -> PlannedBlock | None:
    """The block of ``key`` to read from ``plan`` into ``mv``; None when the
    plan does not give it (a miss, see :func:`planned_miss`, or a GET to
    make: sealed and the daemon decodes, in the object tier only, ...).
    Raises BufferTooSmall."""
    block = plan.blocks.get(key)
    if block is None:
        return None
    if block.size > mv.nbytes:
        raise too_small(key, block.size, mv)
    if block.record is not None and decode == "server":
        return None  # sealed: the caller wants the daemon to decode it
    return block


def planned_miss(plan: Plan, key: str) -> bool:
    """Whether ``plan`` answers ``key`` absent (404)."""
    return plan.others.get(key, (0, ""))[0] == 404


class PlanReader:
    """What the read-plan readers share: plans asked for (``enabled``), the
    decode threads, and who decodes a sealed block (``decode="server"``:
    the daemon, so the key is left for GET)."""

    def __init__(
        self, exchange: Exchange, shards: Shards, decoders: DecodePool, *, enabled: bool, decode: Decode
    ) -> None:
        self._x = exchange
        self._shards = shards
        self._decoders = decoders
        self._enabled = enabled
        self._decode = decode

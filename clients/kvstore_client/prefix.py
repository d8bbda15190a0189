"""Loading a prefix against the clock (``get_prefix``), and what the client
learns of its bandwidth from the loads it makes.

``get_prefix(keys, bufs, deadline_s)`` reads the blocks of ``keys`` in order
into ``bufs``, :data:`GROUP` key per read and :data:`WINDOW` reads at once
(each read through the transports' one order: NIXL, unix read plans, path
plans, HTTP), and returns ``n``: how many leading keys are complete in their
buffers. It returns when the prefix is complete, at the first miss or
failure, or at the deadline, whichever comes first; the deadline is kept
within the event loop's latency (:data:`DEADLINE_SLACK_S` documents the
bound the tests hold it to). A read counts once it has ended: every byte of
``bufs[:n]`` has landed before the call returns, and nothing writes there
after. Reads still running at the deadline are left to end on their own (a
read plan's ``preadv`` in a thread or a NIXL transfer cannot be called
back): until they have, ``bufs[n:]`` may still be written. ``await
client.wait_loads()`` returns once they all have ended; a caller reusing
those buffers waits for it first.

:class:`Bandwidth`: per endpoint and transport, an exponentially weighted
average of the loads that moved enough bytes to say (:data:`MIN_SAMPLE_BYTES`):
the bytes a load read from the endpoint over the load's wall time, so
concurrent reads count as what they are together. The average is of
seconds per byte (a harmonic mean of the rates): one slow load pulls the
estimate down at once (a planner must not promise what the store no longer
delivers), a fast one raises it gradually. An estimate expires
:data:`STALE_S` after its last sample: a client that stopped loading
because the store was slow learns again with its next load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kvstore_client.reads.base import Outcome
from kvstore_client.reads.path import ReadPath
from kvstore_client.sharding import Shards

# Keys per read, and reads at once. One key per read: the reads start in the
# prefix's order and each key counts as soon as it is in (a read of several
# keys counts when its last is, and reads started together share the
# bandwidth, so the head of the prefix would arrive no sooner than its tail).
GROUP = 1
WINDOW = 8
DEADLINE_SLACK_S = 0.05  # what get_prefix may take past its deadline on a loaded machine (loop latency)
MIN_SAMPLE_BYTES = 1 << 20  # a load moving less says more about latency than bandwidth
ALPHA = 0.3  # the weight of a new sample
STALE_S = 30.0  # an estimate without a new sample for this long is forgotten


class Bandwidth:
    """Bytes per second the client has measured, per (endpoint, transport);
    every client's figures also go to the process's (:func:`process_bandwidth`)."""

    def __init__(self, process: Bandwidth | None = None) -> None:
        self._cost: dict[tuple[str, str], tuple[float, float]] = {}  # -> (seconds per byte, when last sampled)
        self._process = process

    def record(self, endpoint: str, transport: str, nbytes: int, seconds: float) -> None:
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        if self._process is not None:
            self._process.record(endpoint, transport, nbytes, seconds)
        sample = seconds / nbytes
        now = time.monotonic()
        old = self._cost.get((endpoint, transport))
        fresh = old is not None and now - old[1] <= STALE_S
        cost = ALPHA * sample + (1 - ALPHA) * old[0] if fresh and old is not None else sample
        self._cost[(endpoint, transport)] = (cost, now)

    def get(self, endpoint: str | None = None, transport: str | None = None) -> float | None:
        """The estimate in bytes per second for ``endpoint`` and ``transport``
        (None: any): the lowest of those that match (a plan must hold on the
        slowest), or None before a load has said (or for STALE_S since)."""
        rates = self.all()
        found = [
            rate
            for (ep, tr), rate in rates.items()
            if (endpoint is None or ep == endpoint) and (transport is None or tr == transport)
        ]
        return min(found) if found else None

    def all(self) -> dict[tuple[str, str], float]:
        """Every estimate not yet stale, in bytes per second."""
        now = time.monotonic()
        return {where: 1.0 / cost for where, (cost, when) in self._cost.items() if now - when <= STALE_S}


PROCESS = Bandwidth()  # what every client of this process measured


def process_bandwidth(endpoint: str | None = None, transport: str | None = None) -> float | None:
    """The lowest bandwidth any client of this process measured (to
    ``endpoint`` over ``transport``; None: any). An engine's scheduler plans
    with what its workers' clients measured, where they share its process."""
    return PROCESS.get(endpoint, transport)


class PrefixLoads:
    """``get_prefix`` for one client: its read path, owners, bandwidth, and
    the reads left running past a deadline."""

    def __init__(self, reads: ReadPath, shards: Shards, bandwidth: Bandwidth) -> None:
        self._reads = reads
        self._shards = shards
        self.bandwidth = bandwidth
        self.running: set[asyncio.Task[list[Outcome]]] = set()

    async def load(self, keys: Sequence[str], mvs: Sequence[memoryview], deadline_s: float) -> int:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        end = loop.time() + max(0.0, deadline_s)
        groups = [range(i, min(i + GROUP, len(keys))) for i in range(0, len(keys), GROUP)]
        via: list[str] = [""] * len(keys)
        outcomes: dict[int, list[Outcome]] = {}  # group -> its keys' outcomes, once its read ended
        running: dict[asyncio.Task[list[Outcome]], int] = {}
        n, launched, last_end = 0, 0, t0
        try:
            while True:
                while launched < len(groups) and len(running) < WINDOW:
                    g = groups[launched]
                    task = loop.create_task(self._read_group(keys, mvs, g, via))
                    running[task] = launched
                    launched += 1
                if not running:
                    break
                left = end - loop.time()
                if left <= 0:
                    break
                done, _ = await asyncio.wait(running, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    gi = running.pop(task)
                    outcomes[gi] = _outcomes(task, len(groups[gi]))
                    last_end = time.monotonic()
                n, finished = _advance(groups, outcomes, n)
                if finished:
                    break
        finally:
            for task in running:  # left to end on their own; wait_loads() waits for them
                self.running.add(task)
                task.add_done_callback(self.running.discard)
        ended = {i: o for gi, outs in outcomes.items() for i, o in zip(groups[gi], outs, strict=True)}
        self.measure(keys, ended, via, last_end - t0)
        return n

    async def _read_group(
        self, keys: Sequence[str], mvs: Sequence[memoryview], g: range, via: list[str]
    ) -> list[Outcome]:
        sub_via = [""] * len(g)
        out = await self._reads.read([keys[i] for i in g], [mvs[i] for i in g], sub_via)
        for j, i in enumerate(g):
            via[i] = sub_via[j]
        return out

    def measure(
        self, keys: Sequence[str], outcomes: Sequence[Outcome] | dict[int, Outcome], via: list[str], seconds: float
    ) -> None:
        """What a load read (its keys' outcomes, by index) over ``seconds``,
        per first owner and transport, into the bandwidth estimates."""
        items = outcomes.items() if isinstance(outcomes, dict) else enumerate(outcomes)
        moved: dict[tuple[str, str], int] = {}
        for i, o in items:
            if isinstance(o, int) and via[i]:
                where = (self._shards.owners(keys[i])[0], via[i])
                moved[where] = moved.get(where, 0) + o
        for (endpoint, transport), nbytes in moved.items():
            self.bandwidth.record(endpoint, transport, nbytes, seconds)

    async def wait(self) -> None:
        """Until every read a deadline left running has ended."""
        while self.running:
            await asyncio.gather(*list(self.running), return_exceptions=True)


def _outcomes(task: asyncio.Task[list[Outcome]], count: int) -> list[Outcome]:
    """A group's outcomes; a read that failed as a whole fails each of its keys."""
    e = task.exception()
    if e is not None:
        return [e] * count
    return task.result()


def _advance(groups: list[range], outcomes: dict[int, list[Outcome]], n: int) -> tuple[int, bool]:
    """The leading keys complete (``n``), and whether the prefix ended (all
    complete, or key ``n`` a miss or a failure)."""
    total = groups[-1].stop if groups else 0
    while n < total:
        outs = outcomes.get(n // GROUP)
        if outs is None:
            return n, False
        if not isinstance(outs[n - groups[n // GROUP].start], int):
            return n, True
        n += 1
    return n, True

"""Load planning: load a hit prefix only where loading it beats recomputing it.

An adapter that loads every hit turns a slow disk, a busy node or a
throttled tenant into a slower service than no cache at all. The planner
weighs, for the ``blocks`` of a hit prefix:

- loading them: ``overhead_s`` plus the longer of ``bytes / bandwidth``, the
  bandwidth the client measured from its own loads (``AsyncClient.bandwidth``),
  and what the tenant's QoS read limit allows: the daemon's token bucket
  lets :data:`QOS_BURST_S` of the rate through at once, then the rate, so
  ``(bytes - QOS_BURST_S * limit) / limit`` (a tenant reading without pause
  has an empty bucket, and its measured bandwidth says so);
- recomputing them: ``blocks * tokens_per_block / prefill_tokens_per_s``,
  the engine's prefill throughput (configured; measured where the adapter
  can, :meth:`LoadPlanner.observe_prefill`).

Both grow with the prefix, so a prefix is loaded whole or not at all: whole
when loading it takes at most ``1 / margin`` of recomputing it. A planned
load runs under a deadline: the time recomputing it would take
(``get_prefix``), so a load that turns out slower than planned stops there
and the engine recomputes what did not arrive; a wrong plan costs at most
that time again.

Without a bandwidth figure (none measured yet, or the last one stale: the
client forgets an estimate 30 s after its last load) the whole hit is
loaded under that same deadline: a probe that measures the bandwidth and
costs at most one recompute time more if the store is slow. Without a
prefill figure there is nothing to weigh: the whole hit is loaded, with no
deadline (as before planning).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

ALPHA = 0.3  # the weight of a new prefill sample
QOS_BURST_S = 0.5  # what the daemon's buckets hold of a rate (kvstore/qos/buckets.py BURST_S)
READ_LIMIT_TTL_S = 10.0  # how long an adapter plans with the tenant's read limit before asking again


@dataclass(frozen=True, slots=True)
class LoadPlan:
    blocks: int  # how many leading hit blocks to load (0: recompute them all)
    deadline_s: float | None  # the most the load may take; None: the adapter's load timeout
    load_s: float | None  # the expected load time (None: unknown)
    recompute_s: float | None  # the expected recompute time (None: unknown)


def told_recompute(log: logging.Logger, plan: LoadPlan, found: int, who: str, what: str) -> int:
    """How many of ``found`` hit ``what`` the plan leaves to recompute,
    logged (``who``: the request or call) when there are any."""
    skipped = found - plan.blocks
    if skipped > 0:
        log.info(
            "kvstore: %s: recomputing %d %s (load %.3f s expected, recompute %.3f s)",
            who,
            skipped,
            what,
            plan.load_s or 0.0,
            plan.recompute_s or 0.0,
        )
    return max(0, skipped)


class LoadPlanner:
    def __init__(self, prefill_tokens_per_s: float = 0.0, margin: float = 1.1, overhead_s: float = 0.002) -> None:
        if prefill_tokens_per_s < 0 or margin < 1.0 or overhead_s < 0:
            raise ValueError(
                f"prefill_tokens_per_s >= 0, margin >= 1 and overhead_s >= 0 are needed; got "
                f"{prefill_tokens_per_s}, {margin}, {overhead_s}"
            )
        self.prefill_tokens_per_s = prefill_tokens_per_s  # 0: unknown
        self.margin = margin
        self.overhead_s = overhead_s

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old <= 0 else ALPHA * rate + (1 - ALPHA) * old

    def plan(
        self,
        blocks: int,
        tokens_per_block: int,
        bytes_per_block: int,
        bandwidth: float | None,
        read_limit: float | None = None,
        overlap_tokens: int = 0,
    ) -> LoadPlan:
        """How many of ``blocks`` hit blocks to load, and by when.
        ``bandwidth``: bytes/s measured (None: not yet); ``read_limit``: the
        tenant's QoS read limit in bytes/s (None or 0: none).
        ``overlap_tokens``: new tokens computed while the load runs (a
        layerwise load: the forward pass starts at once). Then loading takes
        the longer of the load and their compute, recomputing takes both
        computes, one after the other, and the deadline grows by their
        compute."""
        if blocks <= 0:
            return LoadPlan(0, None, None, None)
        if self.prefill_tokens_per_s <= 0:
            return LoadPlan(blocks, None, None, None)
        recompute_s = blocks * tokens_per_block / self.prefill_tokens_per_s
        overlap_s = max(0, overlap_tokens) / self.prefill_tokens_per_s
        nbytes = blocks * bytes_per_block
        times = []
        if bandwidth:
            times.append(nbytes / bandwidth)
        if read_limit:
            times.append(max(0.0, nbytes - QOS_BURST_S * read_limit) / read_limit)
        deadline_s = recompute_s + overlap_s
        if not times:
            return LoadPlan(blocks, deadline_s, None, recompute_s)  # a probe, bounded by its deadline
        load_s = self.overhead_s + max(times)
        if max(load_s, overlap_s) * self.margin <= recompute_s + overlap_s:
            return LoadPlan(blocks, deadline_s, load_s, recompute_s)
        return LoadPlan(0, None, load_s, recompute_s)


class ReadLimit:
    """The tenant's QoS read limit as an adapter plans with it: asked with
    ``ask`` (``AsyncClient.read_limit``, run the adapter's way) at most every
    READ_LIMIT_TTL_S; :meth:`aget` is the same from the client's own loop."""

    def __init__(self, ask: Callable[[], float | None] | None = None) -> None:
        self._ask = ask
        self._asked = -math.inf
        self._limit: float | None = None

    def _due(self) -> bool:
        return time.monotonic() - self._asked > READ_LIMIT_TTL_S

    def get(self) -> float | None:
        if self._ask is not None and self._due():
            self._limit = self._ask()
            self._asked = time.monotonic()
        return self._limit

    async def aget(self, ask: Callable[[], Awaitable[float | None]]) -> float | None:
        if self._due():
            self._limit = await ask()
            self._asked = time.monotonic()
        return self._limit

    def forget(self) -> None:
        """Ask again at the next :meth:`get`."""
        self._asked = -math.inf

"""Which blocks a tenant over its quota gives up (retention.py removes them).

The setting ``quota_eviction`` picks the policy, for every tenant of the node:

- ``lru`` (the default): the least recently read or written blocks first.
- ``probation``: S3-FIFO's idea (Yang et al., SOSP 2023) in the batches the
  quota evicts in. A block not read (nor offered again) since it was stored
  is *on probation*; one that was is *reused*. The oldest blocks on
  probation go first, down to the newest ``PROBATION_SHARE`` of the quota,
  which stay on probation whatever the need; only then do reused blocks go,
  least recently used first. A block evicted on probation is remembered (a
  *ghost*: its key, in the writer's memory, as many as the tenant holds
  blocks, at most ``GHOST_KEYS``); stored again, it counts as reused from
  the next eviction on (it is given an access time then, so it stays
  reused after its ghost is forgotten, and across a restart). Most KV
  blocks are never read again: LRU keeps them as long as the ones that come
  back, this gives them a short stay. bench/README.md has the trace replays
  that measured it against LRU and Belady's optimum.

Ghosts live in memory only: after a restart every block not read since the
last access checkpoint is on probation again and no evicted key is
remembered (the policy then behaves as LRU does for blocks used once).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.config import QUOTA_EVICTION
from kvstore.engine.index import IndexEntry

EVICTION_POLICIES = QUOTA_EVICTION
PROBATION_SHARE = 0.1  # of the quota: the newest blocks on probation, never evicted for reused ones
GHOST_KEYS = 1_000_000  # keys remembered per tenant at most (about 150 bytes each)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A block the quota may remove: not pinned by a lookup's lock."""

    key: str
    entry: IndexEntry
    created_ms: int
    touched_ms: int  # its last read or offer since it was stored (0: none known)

    @property
    def last_ms(self) -> int:
        return max(self.created_ms, self.touched_ms)

    @property
    def size(self) -> int:
        return self.entry.record_len


class _Oldest:
    """The oldest candidates (by a time given with each) whose sizes add up
    to at least ``need``: a heap with the newest on top, never holding much
    more than ``need`` bytes, so a scan of millions of blocks stays small."""

    def __init__(self, need: int) -> None:
        self.need = need
        self._heap: list[tuple[int, str, Candidate]] = []  # (-time, key, candidate)
        self._held = 0

    def offer(self, when: int, c: Candidate) -> None:
        heap = self._heap
        if self._held >= self.need and heap and -heap[0][0] <= when:
            return  # newer than every block already chosen
        heapq.heappush(heap, (-when, c.key, c))
        self._held += c.size
        while heap and self._held - heap[0][2].size >= self.need:
            self._held -= heapq.heappop(heap)[2].size

    def oldest_first(self) -> list[Candidate]:
        return [c for _, _, c in sorted(self._heap, reverse=True)]


def _take(chosen: list[Candidate], need: int) -> list[Candidate]:
    out: list[Candidate] = []
    got = 0
    for c in chosen:
        if got >= need:
            break
        out.append(c)
        got += c.size
    return out


def lru(candidates: Iterable[Candidate], need: int) -> list[Candidate]:
    """The least recently used blocks adding up to ``need`` bytes."""
    oldest = _Oldest(need)
    for c in candidates:
        oldest.offer(c.last_ms, c)
    return oldest.oldest_first()


class Ghosts:
    """Keys one tenant incarnation evicted on probation, and when: a bounded
    FIFO (the longest remembered are forgotten first)."""

    def __init__(self, incarnation: int) -> None:
        self.incarnation = incarnation
        self._evicted: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._evicted)

    def add(self, keys: Iterable[str], when_ms: int, bound: int) -> None:
        evicted = self._evicted
        for key in keys:
            evicted[key] = when_ms
            evicted.move_to_end(key)
        while len(evicted) > bound:
            evicted.popitem(last=False)

    def returned(self, c: Candidate) -> bool:
        """Whether ``c`` was stored again after it was evicted on probation."""
        when = self._evicted.get(c.key)
        return when is not None and c.created_ms >= when


def reused(c: Candidate, ghosts: Ghosts | None) -> bool:
    """Read or offered again since it was stored, or stored again after its
    eviction on probation."""
    return (c.touched_ms > 0 and c.touched_ms >= c.created_ms) or (ghosts is not None and ghosts.returned(c))


@dataclass(frozen=True, slots=True)
class Choice:
    victims: list[Candidate]
    on_probation: list[str]  # the victims' keys that were on probation (ghosts from now)
    held: int  # blocks the tenant held unpinned: the ghosts' bound
    returned: list[Candidate]  # ghosts stored again: reused from now on (retention.py touches them)


def probation(candidates: Iterable[Candidate], need: int, keep_new: int, ghosts: Ghosts | None) -> Choice:
    """The blocks to remove for ``need`` bytes: the oldest on probation
    beyond the newest ``keep_new`` bytes of them, then the least recently
    used reused ones."""
    new, old = _Oldest(need), _Oldest(need)
    new_bytes = held = 0
    returned: list[Candidate] = []
    for c in candidates:
        held += 1
        if c.touched_ms < c.created_ms and ghosts is not None and ghosts.returned(c):
            returned.append(c)
            old.offer(c.last_ms, c)
        elif reused(c, ghosts):
            old.offer(c.last_ms, c)
        else:
            new_bytes += c.size
            new.offer(c.created_ms, c)
    first = _take(new.oldest_first(), min(need, max(0, new_bytes - keep_new)))
    rest = need - sum(c.size for c in first)
    then = _take(old.oldest_first(), rest) if rest > 0 else []
    return Choice(first + then, [c.key for c in first], held, returned)

"""Which blocks a tenant over its quota gives up (retention.py removes them).

A tenant's ``eviction`` picks the policy, or where it sets none the node's
``quota_eviction``:

- ``lru`` (the default): the least recently read or written blocks first.
- ``probation``: S3-FIFO's idea (Yang et al., SOSP 2023) in the batches the
  quota evicts in, with ARC's adaptation (Megiddo and Modha, FAST 2003). A
  block not read (nor offered again) since it was stored is *on
  probation*; one that was is *reused*. The oldest blocks on probation go
  first, down to the newest ``share`` of the quota, which stay on probation
  whatever the need; only then do reused blocks go, least recently used
  first. Evicted keys are remembered (*ghosts*: keys in the writer's
  memory, as many as the tenant holds blocks, at most ``GHOST_KEYS``, in
  two lists: evicted on probation, evicted after a read). A ghost of the
  first list stored again counts as reused from the next eviction on (it
  is given an access time, so it stays reused after its ghost is forgotten
  and across a restart), and grows the share: probation was too short for
  it. One of the second list stored again shrinks the share: probation took
  its room. The share starts at ``PROBATION_SHARE`` and stays within
  ``MIN_SHARE`` and ``MAX_SHARE``. Most KV blocks of chat and agent traffic
  are never read again, and LRU keeps them as long as the ones that come
  back; this gives them a stay as long as the traffic shows it should be.
  bench/README.md has the trace replays that measured it against LRU and
  Belady's optimum: a fixed share of a tenth won on Mooncake's synthetic
  trace and lost on its conversation trace; the adaptive one won on both
  or matched LRU.

The share and the ghosts are the node's learned state: the writer keeps
them in the index (its ``policy`` database, :meth:`Probation.encode`) at
every clean stop and once a minute while they change, and takes them back
at start-up, so a restart neither forgets which keys came back nor starts
the share over. An index rebuilt from the segments starts them over.
"""

from __future__ import annotations

import heapq
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvstore.engine.index import IndexEntry

PROBATION_SHARE = 0.1  # of the quota, at first: the newest blocks on probation, never evicted for reused ones
MIN_SHARE, MAX_SHARE = 0.05, 0.9  # how far the share adapts
GHOST_KEYS = 500_000  # keys remembered per tenant and list at most (about 200 bytes each with 64-character keys)


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


class _Backwards:
    """A key that sorts backwards: the heap's top is then the newest (time,
    key) of those held."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __lt__(self, other: _Backwards) -> bool:
        return self.key > other.key


class _Oldest:
    """The oldest candidates (by a time given with each, then by key: the
    index's order) whose sizes add up to at least ``need``: a heap with the
    newest on top, never holding much more than ``need`` bytes, so a scan of
    millions of blocks stays small."""

    def __init__(self, need: int) -> None:
        self.need = need
        self._heap: list[tuple[int, _Backwards, Candidate]] = []  # (-time, key backwards, candidate)
        self._held = 0

    def offer(self, when: int, c: Candidate) -> None:
        heap = self._heap
        if self._held >= self.need and heap and (-heap[0][0], heap[0][1].key) <= (when, c.key):
            return  # newer than every block already chosen
        heapq.heappush(heap, (-when, _Backwards(c.key), c))
        self._held += c.size
        while heap and self._held - heap[0][2].size >= self.need:
            self._held -= heapq.heappop(heap)[2].size

    def oldest_first(self) -> list[Candidate]:
        return [c for _, _, c in sorted(self._heap, key=lambda e: (-e[0], e[1].key))]


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
    """Keys one tenant evicted, and when: a bounded FIFO (the longest
    remembered are forgotten first)."""

    def __init__(self) -> None:
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

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._evicted.pop(key, None)

    def returned(self, c: Candidate) -> bool:
        """Whether ``c`` was stored again after it was evicted."""
        when = self._evicted.get(c.key)
        return when is not None and c.created_ms >= when

    def items(self) -> Iterator[tuple[str, int]]:
        """(key, evicted ms), the longest remembered first."""
        return iter(self._evicted.items())


@dataclass(slots=True)
class Probation:
    """One tenant incarnation's state under ``probation``, in the writer's
    memory: the share of the quota kept for blocks on probation, and the
    keys evicted on probation and evicted after a read (as ARC's two ghost
    lists: a return of the first kind says probation was too short, and
    grows the share; of the second, that it took room from blocks read
    again, and shrinks it)."""

    incarnation: int
    share: float = PROBATION_SHARE
    evicted_new: Ghosts = field(default_factory=Ghosts)
    evicted_reused: Ghosts = field(default_factory=Ghosts)

    def encode(self) -> bytes:
        """The state as the index keeps it: ``STATE_HEAD`` (version,
        incarnation, share, the two lists' lengths), then each ghost, first
        list first, longest remembered first: ``GHOST_HEAD`` (evicted ms,
        key length) and the key's UTF-8 bytes."""
        # (each list copied in one step: a save encodes on a worker thread
        # while the event loop may evict)
        new, reused = list(self.evicted_new.items()), list(self.evicted_reused.items())
        ghosts = new + reused
        parts = [STATE_HEAD.pack(STATE_VERSION, self.incarnation, self.share, len(new), len(ghosts))]
        for key, when in ghosts:
            raw = key.encode()
            parts += (GHOST_HEAD.pack(when, len(raw)), raw)
        return b"".join(parts)

    @classmethod
    def decode(cls, raw: bytes) -> Probation | None:
        """The state :meth:`encode` wrote; None for one this release cannot
        read (another version, or cut short): the policy starts over, which
        costs hits for a while and loses nothing."""
        if len(raw) < STATE_HEAD.size:
            return None
        version, incarnation, share, n_new, n_all = STATE_HEAD.unpack_from(raw)
        if version != STATE_VERSION or n_new > n_all:
            return None
        state = cls(incarnation, min(MAX_SHARE, max(MIN_SHARE, share)))
        lists = ([], [])  # type: tuple[list[tuple[str, int]], list[tuple[str, int]]]
        at = STATE_HEAD.size
        for i in range(n_all):
            if at + GHOST_HEAD.size > len(raw):
                return None
            when, n = GHOST_HEAD.unpack_from(raw, at)
            at += GHOST_HEAD.size
            if at + n > len(raw):
                return None
            lists[i >= n_new].append((raw[at : at + n].decode(), when))
            at += n
        for ghosts, kept in zip((state.evicted_new, state.evicted_reused), lists, strict=True):
            for key, when in kept:
                ghosts.add((key,), when, GHOST_KEYS)
        return state


STATE_VERSION = 1  # of Probation.encode: another is read as no state
STATE_HEAD = struct.Struct("<BQdII")  # version, incarnation (the tenant's created_ns), share, ghosts of list 1, all
GHOST_HEAD = struct.Struct("<QH")  # evicted ms, key length


def read_since_stored(c: Candidate) -> bool:
    return c.touched_ms > 0 and c.touched_ms >= c.created_ms


@dataclass(frozen=True, slots=True)
class Choice:
    victims: list[Candidate]
    on_probation: list[str] = field(default_factory=list)  # victims never read: ghosts of the first kind
    after_reads: list[str] = field(default_factory=list)  # victims read since stored: of the second kind
    held: int = 0  # blocks the tenant held unpinned: each ghost list's bound
    returned_new: list[Candidate] = field(default_factory=list)  # first kind stored again: reused from now on
    returned_reused: list[str] = field(default_factory=list)  # second kind stored again
    share: float = PROBATION_SHARE  # the share after this scan's returns


class Returns:
    """The ghosts that came back, as a scan of the blocks on probation finds
    them: each moves the share by its size over the quota, times how much
    longer the other ghost list is (ARC's rule), within ``MIN_SHARE`` to
    ``MAX_SHARE``."""

    def __init__(self, state: Probation, quota: int) -> None:
        self.share = state.share
        self.new: list[Candidate] = []  # evicted on probation, stored again: reused from now on
        self.reused: list[str] = []  # evicted after a read, stored again
        self._state, self._quota = state, quota
        self._n_new, self._n_reused = len(state.evicted_new), len(state.evicted_reused)

    def check(self, c: Candidate) -> bool:
        """Whether ``c`` (on probation) came back evicted too soon: it counts as reused."""
        if self._state.evicted_new.returned(c):  # probation grows
            self.new.append(c)
            grow = max(1.0, self._n_reused / max(1, self._n_new)) * c.size / self._quota
            self.share = min(MAX_SHARE, self.share + grow)
            return True
        if self._state.evicted_reused.returned(c):  # room taken from the reused: probation shrinks
            self.reused.append(c.key)
            shrink = max(1.0, self._n_new / max(1, self._n_reused)) * c.size / self._quota
            self.share = max(MIN_SHARE, self.share - shrink)
        return False


def probation(candidates: Iterable[Candidate], need: int, quota: int, state: Probation) -> Choice:
    """The blocks to remove for ``need`` bytes of a tenant with ``quota``:
    the oldest on probation beyond the newest ``state.share`` of the quota,
    then the least recently used of those read since they were stored; the
    share moved first by the ghosts that came back (:class:`Returns`). The
    reference the daemon's walks of its index (retention.py) choose as: it
    scans every candidate."""
    new, old = _Oldest(need), _Oldest(need)
    new_bytes = held = 0
    returns = Returns(state, quota)
    for c in candidates:
        held += 1
        if read_since_stored(c) or returns.check(c):
            old.offer(c.last_ms, c)
            continue
        new_bytes += c.size
        new.offer(c.created_ms, c)
    share = returns.share
    returned_new, returned_reused = returns.new, returns.reused
    keep_new = int(quota * share)
    first = _take(new.oldest_first(), min(need, max(0, new_bytes - keep_new)))
    rest = need - sum(c.size for c in first)
    then = _take(old.oldest_first(), rest) if rest > 0 else []
    return Choice(
        first + then,
        [c.key for c in first],
        [c.key for c in then],
        held,
        returned_new,
        returned_reused,
        share,
    )

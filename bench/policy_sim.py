"""Quota eviction policies simulated on a trace, in blocks, with the daemon's own choice functions.

A fast look at a policy before a replay (``kvstore-bench replay --compare``)
measures it through a daemon. Each request of the trace, in order: its
chain's prefix found (the hit), the found blocks read and the rest stored
(a block stored already is touched), all at the request's time; then, while
the blocks held pass the capacity, an eviction down to 99% of it (as
``QUOTA_LOW``) by ``kvstore.engine.eviction``'s ``lru`` or ``probation``
(its ghosts and share kept as the writer keeps them). Every block counts 1.
Times are the request's number (ties: by key, as the index's order, the
keys hashed as the replay's are);
``--order tail`` instead stamps a chain's blocks so that its head is the
newest (a chain lost from its tail first). ``lru-leaf`` takes only blocks
no held block continues (a chain's tail first, never an orphaned head; it
needs the chain, which the daemon does not know).

    python -m kvstore_bench.policy_sim --trace agents                 # lru and probation at 10% and 30%
    python -m kvstore_bench.policy_sim --trace conversation --capacity 0.3 --policies probation --order tail
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.engine import eviction
from kvstore.engine.eviction import Candidate, Choice, Probation
from kvstore.engine.index import IndexEntry
from kvstore.engine.retention import QUOTA_LOW

from .replayer import block_key
from .trace import Request, load_trace, references, shape, token_hit_ratio, trace_path

PROG = "python -m kvstore_bench.policy_sim"
POLICIES = ("lru", "probation", "lru-leaf")
ORDERS = ("flat", "tail")
TICK = 1_000  # time units a request: room for a chain's positions within it


@dataclass(slots=True)
class _Block:
    created: int
    touched: int
    entry: IndexEntry
    parent: int | None


def _key(block_id: int) -> str:
    """A block's key as the replay names it (a hash: ties between blocks of one
    time break in no order of the chain's)."""
    return block_key("", block_id)


def _entry(created: int) -> IndexEntry:
    return IndexEntry(0, 0, 1, 0, 1, 0, 0, bytes(16), created * 1_000_000)


class Simulation:
    """One policy over the requests, at ``capacity`` blocks."""

    def __init__(self, capacity: int, policy: str, order: str) -> None:
        self.capacity, self.policy, self.order = capacity, policy, order
        self.held: dict[int, _Block] = {}
        self.children: dict[int, int] = {}
        self.state = Probation(0)
        self._ids: dict[str, int] = {}  # key -> block id

    def run(self, requests: Sequence[Request]) -> list[int]:
        """The blocks each request found from the start of its chain."""
        hits = []
        for i, r in enumerate(requests):
            now = (i + 1) * TICK
            chain = r.hash_ids
            found = next((n for n, h in enumerate(chain) if h not in self.held), len(chain))
            hits.append(found)
            for p, h in enumerate(chain):
                t = now + (len(chain) - p if self.order == "tail" else 0)
                b = self.held.get(h)
                if b is not None:
                    b.touched = max(b.touched, t)
                    continue
                parent = chain[p - 1] if p else None
                self.held[h] = _Block(t, 0, _entry(t), parent)
                self._ids.setdefault(_key(h), h)
                if parent is not None:
                    self.children[parent] = self.children.get(parent, 0) + 1
            self._evict(now)
        return hits

    def _candidates(self) -> Iterator[Candidate]:
        leaves_only = self.policy == "lru-leaf"
        for k, b in self.held.items():
            if not (leaves_only and self.children.get(k)):
                yield Candidate(_key(k), b.entry, b.created, b.touched)

    def _evict(self, now: int) -> None:
        while len(self.held) > self.capacity:
            need = len(self.held) - int(self.capacity * QUOTA_LOW)
            if self.policy == "probation":
                choice = eviction.probation(self._candidates(), need, self.capacity, self.state)
                self._remember(choice, now)
            else:
                choice = Choice(eviction.lru(self._candidates(), need))
            if not choice.victims:
                return
            for c in choice.victims:
                b = self.held.pop(self._ids[c.key])
                if b.parent is not None and b.parent in self.children:
                    self.children[b.parent] -= 1

    def _remember(self, choice: Choice, now: int) -> None:
        """What the writer learns from an eviction (retention.Retention._remember)."""
        s = self.state
        for c in choice.returned_new:
            b = self.held[self._ids[c.key]]
            b.touched = max(b.touched, c.created_ms)
        s.evicted_new.forget(c.key for c in choice.returned_new)
        s.evicted_reused.forget(choice.returned_reused)
        s.share = choice.share
        bound = min(choice.held, eviction.GHOST_KEYS)
        s.evicted_new.add(choice.on_probation, now, bound)
        s.evicted_reused.add(choice.after_reads, now, bound)


def _fractions(text: str) -> list[float]:
    try:
        out = [float(f) for f in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected fractions such as 0.1,0.3") from None
    if not out or not all(0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"{text!r}: each fraction must be in (0, 1]")
    return out


def _names(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"{text!r}: expected some of {', '.join(allowed)}")
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--trace",
        type=trace_path,
        default=trace_path("synthetic"),
        help="a trace file, or synthetic, conversation, agents",
    )
    ap.add_argument("--requests", type=int, help="only the first N requests")
    ap.add_argument(
        "--capacity",
        type=_fractions,
        default=[0.1, 0.3],
        help="capacities as fractions of the unique blocks (default 0.1,0.3)",
    )
    ap.add_argument(
        "--policies", type=_names(POLICIES), default=["lru", "probation"], help=f"some of {', '.join(POLICIES)}"
    )
    ap.add_argument("--order", type=_names(ORDERS), default=["flat"], help="flat (the daemon's), tail, or both")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    requests = load_trace(args.trace, args.requests)
    cut = shape(requests)
    print(f"{args.trace.name}: {cut.requests:,} requests, {cut.unique_blocks:,} unique blocks")
    print(f"{'capacity':>9}  {'policy':<10} {'order':<5} {'token hit':>9} {'vs LRU':>7} {'of Belady':>9}  seconds")
    for fraction in args.capacity:
        capacity = max(1, int(cut.unique_blocks * fraction))
        refs = references(requests, capacity)
        assert refs.lru is not None and refs.belady is not None  # (a capacity was given)
        lru_ref = token_hit_ratio(requests, refs.lru, 512)
        best = token_hit_ratio(requests, refs.belady, 512)
        print(f"{capacity:>9,}  {'LRU ref':<10} {'':<5} {lru_ref:>9.4f} {'':>7} {lru_ref / best:>9.1%}")
        print(f"{capacity:>9,}  {'Belady':<10} {'':<5} {best:>9.4f}")
        for policy in args.policies:
            for order in args.order:
                t0 = time.perf_counter()
                hit = token_hit_ratio(requests, Simulation(capacity, policy, order).run(requests), 512)
                took = time.perf_counter() - t0
                row = f"{capacity:>9,}  {policy:<10} {order:<5} {hit:>9.4f}"
                print(f"{row} {hit / lru_ref - 1:>+7.1%} {hit / best:>9.1%}  {took:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

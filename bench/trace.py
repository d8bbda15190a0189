"""Request traces in Mooncake's format, and the caches a replay is measured against.

A trace is JSONL, one request per line (Mooncake's FAST'25 release,
``data/traces/README.md``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 2353]}

A trace of the prompts' tokens is read too: ``token_ids`` (or
``input_ids``, as tokenizers name them) instead of ``hash_ids``, with
``timestamp`` and ``output_length`` optional; its chains are made here
(:class:`PrefixChains`), so logged prompts of any engine replay as they are::

    {"timestamp": 27482, "token_ids": [128000, 9906, 1917, ...], "output_length": 52}

``hash_ids`` is the prompt's chain of prefix blocks of ``tokens_per_block``
tokens (512 in Mooncake's traces): block ``i`` holds tokens
``[i * tokens_per_block, (i + 1) * tokens_per_block)`` of the prompt, so the
last block of a chain may hold fewer. A request whose first ``n`` blocks are
stored is a hit for the tokens of those ``n`` blocks (a prefix hit: a block
after a missing one is of no use to the engine, which has to recompute from
the first missing token on).

The references replay the same requests, in the trace's order, one after
the other, through a cache of blocks with the access pattern a replay gives
the daemon: a lookup of the chain (which touches nothing), then every block
of the chain in order, the found prefix loaded (a read, which touches it)
and the rest stored (a new block enters; one stored already is touched, as
the daemon does for a PUT of a key it holds):

* **unbounded**: every block ever stored stays (the most any cache finds);
* **LRU** at ``capacity`` blocks: the least recently used block leaves first
  (what a tenant's quota does in the daemon, by bytes);
* **Belady** at ``capacity`` blocks: Belady's MIN over the same block
  accesses (evict the block whose next use is farthest away; do not keep a
  new block needed later than every block held), ties broken by next use
  within the chain, so a chain loses its tail before its head. MIN is
  proven the offline optimum for block hits, not for prefix hits (a block
  kept after a lost one counts for nothing); on traces whose ids are prefix
  hashes (an id stands for its whole prefix, as in Mooncake's traces: no id
  of the shipped trace follows two different ids) it found as many prefix
  blocks as an exhaustive search of every eviction on thousands of small
  random traces (tests/unit/test_replay.py runs 200 of them).
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import json
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACES = Path(__file__).resolve().parent / "data" / "traces"
SYNTHETIC = TRACES / "synthetic_trace.jsonl"  # Mooncake's FAST'25 synthetic trace
CONVERSATION = TRACES / "conversation_trace.jsonl.gz"  # Mooncake's FAST'25 conversation trace
AGENTS = TRACES / "agent_sessions.jsonl.gz"  # long agent sessions (agent_trace.py made it)
NAMED = {"synthetic": SYNTHETIC, "conversation": CONVERSATION, "agents": AGENTS}  # traces shipped with the package


def trace_path(text: str) -> Path:
    """A trace's file: one of ``NAMED``, or a path."""
    return NAMED.get(text, Path(text))


MOONCAKE_TOKENS_PER_BLOCK = 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
TOKEN_FIELDS = ("token_ids", "input_ids")  # a trace of prompts' tokens instead of block ids
NEVER = float("inf")


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: when it arrives and its chain of prefix blocks."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, i: int, tokens_per_block: int) -> int:
        """Tokens of the prompt in block ``i`` (the last block may hold fewer)."""
        return max(0, min(tokens_per_block, self.input_length - i * tokens_per_block))

    def prefix_tokens(self, blocks: int, tokens_per_block: int) -> int:
        """Tokens of the prompt in its first ``blocks`` blocks."""
        return max(0, min(blocks * tokens_per_block, self.input_length))


def _int_field(doc: dict[str, object], name: str, where: str) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {name} must be an integer of at least 0, got {value!r}")
    return value


class PrefixChains:
    """Block ids for traces of token ids: each full block of
    ``tokens_per_block`` tokens is named by a hash of its tokens and of the
    block before it (the prefix hashing of engines' prefix caches), and each
    distinct hash gets the next integer id. A prompt's last, partial block
    gets none: engines cache full blocks only, so its tokens are never a hit."""

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._ids: dict[bytes, int] = {}

    def chain(self, tokens: Sequence[int]) -> tuple[int, ...]:
        tpb = self.tokens_per_block
        digest = b""
        out: list[int] = []
        for start in range(0, len(tokens) - tpb + 1, tpb):
            block = struct.pack(f"<{tpb}q", *tokens[start : start + tpb])
            digest = hashlib.blake2b(digest + block, digest_size=16).digest()
            out.append(self._ids.setdefault(digest, len(self._ids)))
        return tuple(out)


def _token_ids(doc: dict[str, object], where: str) -> tuple[str, list[int]] | None:
    for name in TOKEN_FIELDS:
        if name in doc:
            value = doc[name]
            ok = isinstance(value, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and -(1 << 63) <= t < 1 << 63 for t in value
            )
            if not ok:
                raise ValueError(f"{where}: {name} must be a list of integers")
            return name, value  # type: ignore[return-value]
    return None


def parse_request(line: str, where: str, chains: PrefixChains | None = None) -> Request:
    """One JSONL line; a ValueError names ``where`` (file:line) and the field.
    A line with ``token_ids`` (or ``input_ids``) instead of ``hash_ids`` has
    its chain made by ``chains``; its ``input_length`` is its token count and
    ``timestamp`` and ``output_length`` default to 0."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected an object with {', '.join(FIELDS)}")
    if "hash_ids" not in doc and (tokens := _token_ids(doc, where)) is not None:
        if chains is None:
            raise ValueError(f"{where}: {tokens[0]} needs the tokens per block to make the chain")
        name, ids_of = tokens
        if "input_length" in doc and doc["input_length"] != len(ids_of):
            raise ValueError(f"{where}: input_length {doc['input_length']!r} is not the {len(ids_of)} {name}")
        return Request(
            timestamp_ms=_int_field(doc, "timestamp", where) if "timestamp" in doc else 0,
            input_length=len(ids_of),
            output_length=_int_field(doc, "output_length", where) if "output_length" in doc else 0,
            hash_ids=chains.chain(ids_of),
        )
    ids = doc.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers (or give the prompt's token_ids)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: hash_ids names a block twice in one chain")
    return Request(
        timestamp_ms=_int_field(doc, "timestamp", where),
        input_length=_int_field(doc, "input_length", where),
        output_length=_int_field(doc, "output_length", where),
        hash_ids=tuple(ids),
    )


def load_trace(
    path: Path, limit: int | None = None, tokens_per_block: int = MOONCAKE_TOKENS_PER_BLOCK
) -> list[Request]:
    """The first ``limit`` requests of the trace at ``path`` (all: None), in
    arrival order (a stable sort by timestamp: a file out of order is replayed
    in time order). Blank lines are skipped; a bad line is a ValueError.
    A file named ``*.gz`` is read through gzip.
    Lines of token ids are chained in blocks of ``tokens_per_block``."""
    requests: list[Request] = []
    chains = PrefixChains(tokens_per_block)
    with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            requests.append(parse_request(line, f"{path.name}:{number}", chains))
    if not requests:
        raise ValueError(f"{path}: no requests")
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests if limit is None else requests[:limit]


@dataclass(frozen=True, slots=True)
class TraceShape:
    """What a cut of a trace holds, counted from it."""

    requests: int
    tokens: int
    blocks: int  # block references: the chains' lengths added up
    unique_blocks: int
    span_ms: int


def shape(requests: Sequence[Request]) -> TraceShape:
    unique = {h for r in requests for h in r.hash_ids}
    span = requests[-1].timestamp_ms - requests[0].timestamp_ms if requests else 0
    return TraceShape(
        requests=len(requests),
        tokens=sum(r.input_length for r in requests),
        blocks=sum(len(r.hash_ids) for r in requests),
        unique_blocks=len(unique),
        span_ms=span,
    )


# -- the reference caches ------------------------------------------------------------


class Unbounded:
    """Every block stored stays."""

    def __init__(self) -> None:
        self._held: set[int] = set()

    def __contains__(self, block: int) -> bool:
        return block in self._held

    def use(self, block: int, position: int) -> None:
        self._held.add(block)


class Lru:
    """At most ``capacity`` blocks; the least recently used leaves first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._held

    def use(self, block: int, position: int) -> None:
        if block in self._held:
            self._held.move_to_end(block)
            return
        if self.capacity <= 0:
            return
        self._held[block] = None
        if len(self._held) > self.capacity:
            self._held.popitem(last=False)


class Belady:
    """At most ``capacity`` blocks, chosen with the whole future known: the
    block whose next use (a position in the access sequence) is farthest
    away leaves first, and a new block needed later than every block held is
    not kept. ``next_use[p]``: the position of the next access to the block
    accessed at position ``p`` (NEVER: none)."""

    def __init__(self, capacity: int, next_use: Sequence[float]) -> None:
        self.capacity = capacity
        self._next_use = next_use
        self._held: dict[int, float] = {}  # block -> its next use
        self._heap: list[tuple[float, int]] = []  # (-next use, block); stale entries skipped

    def __contains__(self, block: int) -> bool:
        return block in self._held

    def use(self, block: int, position: int) -> None:
        nxt = self._next_use[position]
        if block in self._held or len(self._held) < self.capacity:
            self._keep(block, nxt)
            return
        if self.capacity <= 0:
            return
        far_block, far_use = self._farthest()
        if nxt >= far_use:
            return  # needed later than all held: keeping it would cost a block needed sooner
        del self._held[far_block]
        heapq.heappop(self._heap)
        self._keep(block, nxt)

    def _keep(self, block: int, nxt: float) -> None:
        self._held[block] = nxt
        heapq.heappush(self._heap, (-nxt, block))

    def _farthest(self) -> tuple[int, float]:
        while True:
            neg, block = self._heap[0]
            if self._held.get(block) == -neg:
                return block, -neg
            heapq.heappop(self._heap)  # the block was used again (or left) since this entry


def next_uses(requests: Sequence[Request]) -> list[float]:
    """Per position of the access sequence (every block of every request, in
    order), the position of the next access to the same block (NEVER: none)."""
    flat = [h for r in requests for h in r.hash_ids]
    out: list[float] = [NEVER] * len(flat)
    last: dict[int, int] = {}
    for p in range(len(flat) - 1, -1, -1):
        out[p] = last.get(flat[p], NEVER)
        last[flat[p]] = p
    return out


def prefix_hits(requests: Iterable[Request], cache: Unbounded | Lru | Belady) -> list[int]:
    """Per request, the blocks from the start of its chain that ``cache``
    held when it arrived; then each of its blocks is used in chain order."""
    hits: list[int] = []
    position = 0
    for r in requests:
        n = 0
        for h in r.hash_ids:
            if h not in cache:
                break
            n += 1
        hits.append(n)
        for h in r.hash_ids:
            cache.use(h, position)
            position += 1
    return hits


@dataclass(frozen=True, slots=True)
class References:
    """Per request, the prefix blocks each reference cache found."""

    capacity: int | None  # blocks of the LRU and Belady caches; None: not known (no LRU, no Belady)
    unbounded: list[int]
    lru: list[int] | None
    belady: list[int] | None


def references(requests: Sequence[Request], capacity: int | None) -> References:
    """The three references over ``requests`` (LRU and Belady at ``capacity``)."""
    unbounded = prefix_hits(requests, Unbounded())
    if capacity is None:
        return References(None, unbounded, None, None)
    lru = prefix_hits(requests, Lru(capacity))
    belady = prefix_hits(requests, Belady(capacity, next_uses(requests)))
    return References(capacity, unbounded, lru, belady)


def token_hit_ratio(requests: Sequence[Request], hits: Sequence[int], tokens_per_block: int) -> float:
    """Tokens in the requests' hit prefixes over all their input tokens."""
    total = sum(r.input_length for r in requests)
    hit = sum(r.prefix_tokens(n, tokens_per_block) for r, n in zip(requests, hits, strict=True))
    return hit / total if total else 0.0

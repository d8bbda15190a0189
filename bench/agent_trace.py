"""A trace of long agent sessions, synthesized: each turn re-reads the session's whole growing prompt.

Coding agents (SWE-agent, OpenHands, Claude Code and the like) run a loop:
the model reads its system prompt, its tool definitions, the task and every
action and tool result so far, and answers with the next action; the tool's
output is appended and the loop goes on. Each turn's prompt is the last
turn's prompt plus two appended parts, so a turn's chain of prefix blocks is
the last turn's full blocks and a few new ones; a few agent configurations
(system prompt and tools) are shared by every session that runs them. No
public trace of such sessions in Mooncake's format exists (Mooncake's
``toolagent_trace.jsonl`` is not in its repository), so this module makes one
from that shape, with every choice a parameter (:class:`AgentShape`):

- ``kinds`` agent configurations, each a system prompt plus tool definitions
  of ``system_tokens`` (uniform in the range): the hot shared prefixes;
- ``sessions`` sessions, each of one kind chosen uniformly, starting at
  Poisson arrivals ``start_gap_s`` apart on average, with a task of
  ``task_tokens`` (uniform);
- ``turns`` turns per session (uniform), cut at ``max_context`` tokens;
- each turn appends the model's action (``output_tokens``: log-normal,
  median and sigma) and the tool's result (``tool_tokens``: log-normal);
- the next turn arrives after the action's decode
  (``decode_ms_per_token``) and the tool's run (``tool_s``: log-normal).

Block ids are prefix hashes, as in Mooncake's traces: a full block of a
session's prompt has the same id in every later turn of the session; a
block wholly inside the kind's system prompt has the same id in every
session of that kind; a prompt's last, partial block is its own (never
read again). Requests are ordered by arrival. Deterministic for a seed.

    python -m kvstore_bench.agent_trace --out agents.jsonl     # the default shape: 80 sessions, ~2,000 requests
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .argtypes import positive_int
from .trace import MOONCAKE_TOKENS_PER_BLOCK, Request

PROG = "python -m kvstore_bench.agent_trace"


@dataclass(frozen=True, slots=True)
class AgentShape:
    """The parameters of a synthesized agent-session trace (see the module)."""

    sessions: int = 80
    kinds: int = 3
    system_tokens: tuple[int, int] = (4_000, 12_000)
    task_tokens: tuple[int, int] = (500, 4_000)
    turns: tuple[int, int] = (10, 40)
    output_tokens: tuple[float, float] = (150.0, 0.8)  # log-normal: median, sigma
    tool_tokens: tuple[float, float] = (1_500.0, 1.2)
    tool_s: tuple[float, float] = (4.0, 1.0)
    decode_ms_per_token: float = 25.0
    start_gap_s: float = 1.0
    max_context: int = 128_000
    tokens_per_block: int = MOONCAKE_TOKENS_PER_BLOCK
    seed: int = 0


def _lognormal(rng: random.Random, median_sigma: tuple[float, float], cap: float) -> float:
    median, sigma = median_sigma
    return min(cap, rng.lognormvariate(math.log(median), sigma))


class _Ids:
    """Integer ids for the blocks' identities, in the order first named."""

    def __init__(self) -> None:
        self._ids: dict[tuple[object, ...], int] = {}

    def __call__(self, *identity: object) -> int:
        return self._ids.setdefault(identity, len(self._ids))


def _session(
    shape: AgentShape, rng: random.Random, ids: _Ids, number: int, start_ms: float, system: list[int]
) -> Iterator[tuple[float, Request]]:
    tpb = shape.tokens_per_block
    kind = rng.randrange(shape.kinds)
    shared_blocks = system[kind] // tpb  # blocks wholly inside the kind's system prompt
    tokens = system[kind] + rng.randint(*shape.task_tokens)
    at = start_ms
    for turn in range(rng.randint(*shape.turns)):
        if tokens > shape.max_context:
            return
        full = tokens // tpb
        chain = [ids("system", kind, i) if i < shared_blocks else ids("session", number, i) for i in range(full)]
        if tokens % tpb:
            chain.append(ids("partial", number, turn))
        output = max(1, round(_lognormal(rng, shape.output_tokens, 8_000)))
        yield at, Request(round(at), tokens, output, tuple(chain))
        tool = round(_lognormal(rng, shape.tool_tokens, 32_000))
        at += output * shape.decode_ms_per_token + 1000 * _lognormal(rng, shape.tool_s, 600)
        tokens += output + tool


def agent_sessions(shape: AgentShape = AgentShape()) -> list[Request]:
    """The trace's requests, in arrival order."""
    rng = random.Random(shape.seed)
    ids = _Ids()
    system = [rng.randint(*shape.system_tokens) for _ in range(shape.kinds)]
    sessions = []
    start = 0.0
    for number in range(shape.sessions):
        sessions.append(_session(shape, rng, ids, number, start, system))
        start += rng.expovariate(1 / (1000 * shape.start_gap_s))
    merged = heapq.merge(*(list(s) for s in sessions), key=lambda item: item[0])
    return [request for _, request in merged]


def to_jsonl(requests: list[Request]) -> str:
    return "".join(
        json.dumps(
            {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )
        + "\n"
        for r in requests
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, help="write the trace here (default: stdout)")
    ap.add_argument("--sessions", type=positive_int, default=80, help="sessions (default 80)")
    ap.add_argument("--seed", type=int, default=0, help="the random seed (default 0)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    text = to_jsonl(agent_sessions(AgentShape(sessions=args.sessions, seed=args.seed)))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to first token: load a prefix's KV cache from the store, or recompute it (prefill)?

A deliberately simple, linear model; every figure is an input, nothing is measured:

* load time      = latency + N x bytes_per_token / throughput
* recompute time = N / prefill_rate

``throughput`` is the store's delivered bandwidth in GB/s (1e9 bytes/s, not
gigabits) for the whole model's KV cache (all layers, all ranks); ``latency``
is a fixed cost per request (round trip, first byte); ``prefill_rate`` is the
serving cluster's prefill throughput in tokens/s.

Linear prefill is optimistic for long contexts: attention makes prefill cost
grow quadratically in N, so past a few tens of thousands of tokens real
recompute is slower than this model says, and loading's advantage larger.
Neither model includes decode, queueing, or the overlap of loading with
compute.

Break-even: load = recompute where latency + N x b/T = N/P, i.e.
``N* = latency / (1/P - b/T)``. Let ``d = 1/P - b/T`` (seconds saved per token
by loading instead of recomputing):

* ``d > 0``: loading wins for every N > N* (every N > 0 when latency is 0:
  "always");
* ``d <= 0``: loading a token costs at least as much as computing it, and the
  latency only adds to it: loading never wins ("never").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["always", "above", "never"]


def _check_positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")


def _check_latency(latency_s: float) -> None:
    if not (latency_s >= 0 and math.isfinite(latency_s)):
        raise ValueError(f"latency must be at least 0 and finite, got {latency_s!r}")


def load_seconds(tokens: int, bytes_per_token: int, throughput_gbps: float, latency_s: float = 0.0) -> float:
    """latency + tokens x bytes_per_token / (throughput_gbps x 1e9)."""
    _check_positive("throughput", throughput_gbps)
    _check_latency(latency_s)
    return latency_s + tokens * bytes_per_token / (throughput_gbps * 1e9)


def recompute_seconds(tokens: int, prefill_tps: float) -> float:
    """tokens / prefill_tps (linear prefill)."""
    _check_positive("prefill rate", prefill_tps)
    return tokens / prefill_tps


@dataclass(frozen=True)
class BreakEven:
    """Where loading starts to beat recomputing."""

    verdict: Verdict
    tokens: float | None  # N*: loading wins for N > N*; 0 for "always", None for "never"
    saved_s_per_token: float  # d = 1/P - b/T

    def describe(self) -> str:
        if self.verdict == "always":
            return "loading always wins (no fixed latency, and a token loads faster than it computes)"
        if self.verdict == "never":
            return "loading never wins (a token loads no faster than it computes)"
        assert self.tokens is not None
        return f"loading wins above {self.tokens:,.0f} tokens"


def break_even(bytes_per_token: int, throughput_gbps: float, prefill_tps: float, latency_s: float = 0.0) -> BreakEven:
    """N* = latency / (1/P - b/T) when 1/P > b/T; see the module docstring."""
    _check_positive("throughput", throughput_gbps)
    _check_positive("prefill rate", prefill_tps)
    _check_latency(latency_s)
    saved = 1.0 / prefill_tps - bytes_per_token / (throughput_gbps * 1e9)
    if saved <= 0:
        return BreakEven("never", None, saved)
    if latency_s == 0:
        return BreakEven("always", 0.0, saved)
    return BreakEven("above", latency_s / saved, saved)


@dataclass(frozen=True)
class TtftRow:
    tokens: int
    kv_bytes: int
    load_s: float
    recompute_s: float

    @property
    def speedup(self) -> float:
        """recompute / load: above 1, loading is faster."""
        return self.recompute_s / self.load_s if self.load_s > 0 else math.inf

    @property
    def winner(self) -> str:
        if self.load_s < self.recompute_s:
            return "load"
        return "recompute" if self.recompute_s < self.load_s else "tie"


def ttft_row(
    tokens: int, bytes_per_token: int, throughput_gbps: float, prefill_tps: float, latency_s: float = 0.0
) -> TtftRow:
    if tokens < 0:
        raise ValueError(f"tokens must be at least 0, got {tokens}")
    return TtftRow(
        tokens=tokens,
        kv_bytes=tokens * bytes_per_token,
        load_s=load_seconds(tokens, bytes_per_token, throughput_gbps, latency_s),
        recompute_s=recompute_seconds(tokens, prefill_tps),
    )

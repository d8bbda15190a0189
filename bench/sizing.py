"""KV-cache sizing: bytes per token, per block, per tensor-parallel rank, per session, and fleet capacity.

One token of KV cache holds, in every decoder layer, one key and one value
vector per KV head::

    bytes per token = layers x 2 (K and V) x kv_heads x head_dim x dtype_bytes

Llama-3.1-405B in fp16: 126 x 2 x 8 x 128 x 2 = 516,096 B (504 KiB) per token;
a 127,188-token session is 65,641,218,048 B = 65.6 GB = 61.1 GiB (the "~61 GB"
quoted for it is GiB). Capacity for 100,000 users x 30 GB x 15 (retention) is
4.5e16 B = 45 PB (40.0 PiB).

Units: GB, TB, PB are decimal (1e9, 1e12, 1e15 bytes); GiB, TiB, PiB binary
(2**30, 2**40, 2**50). The formatters print both.

Tensor parallelism: attention heads are split across the ``tp`` ranks, so each
rank holds ``kv_heads / tp`` KV heads of every layer (the layout of vLLM and
SGLang). ``tp`` must divide ``kv_heads``, or, when ``tp > kv_heads``, be a
multiple of it: then each rank holds one KV head and each head is *replicated*
on ``tp / kv_heads`` ranks, so the cluster stores ``tp / kv_heads`` copies
(``bytes_per_token_all_ranks`` counts them; a store that keeps one copy per
distinct head needs only ``bytes_per_token``). Any other ``tp`` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import ModelGeometry

KB, MB, GB, TB, PB, EB = 1e3, 1e6, 1e9, 1e12, 1e15, 1e18
KiB, MiB, GiB, TiB, PiB, EiB = 2**10, 2**20, 2**30, 2**40, 2**50, 2**60
_DECIMAL = (("EB", EB), ("PB", PB), ("TB", TB), ("GB", GB), ("MB", MB), ("kB", KB))
_BINARY = (("EiB", EiB), ("PiB", PiB), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def kv_bytes_per_token(model: ModelGeometry) -> int:
    """layers x 2 (K and V) x kv_heads x head_dim x dtype_bytes."""
    return model.layers * 2 * model.kv_heads * model.head_dim * model.dtype_bytes


def kv_bytes_per_block(model: ModelGeometry, tokens_per_block: int) -> int:
    """One full block of ``tokens_per_block`` tokens (all layers, all KV heads)."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens per block must be at least 1, got {tokens_per_block}")
    return kv_bytes_per_token(model) * tokens_per_block


def kv_bytes_per_session(model: ModelGeometry, context_tokens: int) -> int:
    """The KV cache of one session of ``context_tokens`` tokens."""
    if context_tokens < 0:
        raise ValueError(f"context tokens must be at least 0, got {context_tokens}")
    return kv_bytes_per_token(model) * context_tokens


@dataclass(frozen=True)
class TpShard:
    """What one tensor-parallel rank holds of the KV cache."""

    tp: int
    kv_heads_per_rank: int
    replication: int  # ranks holding each KV head: 1 unless tp > kv_heads
    bytes_per_token_per_rank: int
    bytes_per_token_all_ranks: int  # tp x per rank: bytes_per_token x replication


def tp_shard(model: ModelGeometry, tp: int) -> TpShard:
    """Split the KV heads over ``tp`` ranks; see the module docstring for the rules."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp}")
    if tp <= model.kv_heads:
        if model.kv_heads % tp:
            raise ValueError(
                f"tensor-parallel size {tp} does not divide {model.name}'s {model.kv_heads} KV heads "
                f"(use a divisor of {model.kv_heads}, or a multiple of it to replicate heads)"
            )
        heads, replication = model.kv_heads // tp, 1
    else:
        if tp % model.kv_heads:
            raise ValueError(
                f"tensor-parallel size {tp} exceeds {model.name}'s {model.kv_heads} KV heads "
                f"and is not a multiple of it, so the heads cannot be replicated evenly"
            )
        heads, replication = 1, tp // model.kv_heads
    per_rank = model.layers * 2 * heads * model.head_dim * model.dtype_bytes
    return TpShard(tp, heads, replication, per_rank, per_rank * tp)


def capacity_bytes(users: int, per_user_bytes: float, retention: float) -> float:
    """users x KV per user x retention multiplier (copies/versions kept per user's working set)."""
    if users < 0:
        raise ValueError(f"users must be at least 0, got {users}")
    if per_user_bytes < 0:
        raise ValueError(f"bytes per user must be at least 0, got {per_user_bytes}")
    if retention <= 0:
        raise ValueError(f"retention multiplier must be positive, got {retention}")
    return users * per_user_bytes * retention


def _scaled(n: float, units: tuple[tuple[str, float], ...]) -> str:
    for name, size in units:
        if abs(n) >= size:
            return f"{n / size:.2f} {name}"
    return f"{n:.0f} B"


def fmt_decimal(n: float) -> str:
    """``65.64 GB``: the largest decimal unit the value reaches."""
    return _scaled(n, _DECIMAL)


def fmt_binary(n: float) -> str:
    """``61.13 GiB``: the largest binary unit the value reaches."""
    return _scaled(n, _BINARY)


def fmt_bytes(n: float) -> str:
    """``65,641,218,048 B = 65.64 GB = 61.13 GiB`` (the exact count, then both units)."""
    exact = f"{round(n):,} B"
    if abs(n) < KB:
        return exact
    return f"{exact} = {fmt_decimal(n)} = {fmt_binary(n)}"

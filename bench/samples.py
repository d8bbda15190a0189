"""Where the benchmark's real KV-cache samples are: ``data/kv`` beside this
module, in a checkout (bench/data/kv) and in the wheel alike (package data of
kvstore_bench). ``data/kv/README.md`` says what each file holds and where it
came from."""

from __future__ import annotations

from pathlib import Path

SAMPLES = Path(__file__).resolve().parent / "data" / "kv"
# The one sample the single-block benchmarks repeat (plan, nixl, hostile).
GEMMA_BF16 = SAMPLES / "gemma3-270m.bf16.layers8-9.bin"


def load_pool(samples: Path) -> bytes:
    """Every ``*.bin`` of ``samples``, concatenated (real KV-cache bytes)."""
    files = sorted(samples.glob("*.bin"))
    if not files:
        raise SystemExit(f"no *.bin KV samples in {samples}")
    return b"".join(p.read_bytes() for p in files)

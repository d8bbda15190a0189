"""One vLLM engine process for the tests: greedy generation of some prompts,
results as JSON. Run as ``python -m tests.engines.vllm_engine SPEC.json OUT.json``.

SPEC: ``{"model": dir, "prompts": [str or token ids], "max_tokens": n, "kv_transfer_config": {...} | null,
"kv_events_config": {...}?}`` (the engine's own KV events, e.g. over ZMQ).
OUT: ``{"outputs": [{"token_ids": [...], "text": str, "num_cached_tokens": n}], "seconds": s}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.config.kv_events import KVEventsConfig

    kv = spec.get("kv_transfer_config")
    events = spec.get("kv_events_config")
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=spec.get("max_model_len", 256),
        enforce_eager=True,
        block_size=32,
        seed=0,
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_transfer_config=KVTransferConfig(**kv) if kv else None,
        kv_events_config=KVEventsConfig(**events) if events else None,
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True)
    t0 = time.monotonic()
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in spec["prompts"]]
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - t0
    if events:
        time.sleep(1.0)  # the publisher thread sends the last batches
    outputs = [
        {
            "token_ids": list(r.outputs[0].token_ids),
            "text": r.outputs[0].text,
            "num_cached_tokens": r.num_cached_tokens or 0,
            "prompt_tokens": len(r.prompt_token_ids or []),
        }
        for r in results
    ]
    Path(out_path).write_text(json.dumps({"outputs": outputs, "seconds": seconds}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

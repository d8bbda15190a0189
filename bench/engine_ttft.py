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
    .venv-engines/bin/python -m bench.engine_ttft --prompt-tokens 2048 --runs 3 --json ttft.json

``build_llama`` (also used by tests/engines) writes a Llama config, random
weights and a small byte-level BPE tokenizer to a directory in seconds.
"""

from __future__ import annotations

from pathlib import Path

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

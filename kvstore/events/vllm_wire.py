"""Residency events in vLLM's KV-event wire format (``vllm/distributed/
kv_events.py``), so routers that consume an engine's events consume ours.

A batch is a msgpack array ``[ts, events, data_parallel_rank]`` (the rank
is nil: a storage node has none). Each event is, in the current encoding
(``map``, vLLM 0.10 and later), a map tagged by ``"type"``:

- ``{"type": "BlockStored", "block_hashes": [h], "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name"}``, one per
  block (each block has its own parent and tokens; ``extra_keys`` only when
  the engine sent some);
- ``{"type": "BlockRemoved", "block_hashes": [...], "medium"}``, the blocks
  gone from one medium together;
- ``{"type": "AllBlocksCleared"}``.

The older encoding (``array``, vLLM before 0.10, which some routers still
decode) is the same fields as an array led by the tag:
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgpack

from kvstore.events.model import Event

Encoding = Literal["map", "array"]


def vllm_events(ev: Event, mediums: dict[str, str], encoding: Encoding) -> list[Any]:
    """``ev`` as vLLM events (several for a multi-block store)."""
    if ev.kind == "cleared":
        return [{"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]]
    medium = mediums[ev.tier or "local"]
    if ev.kind == "removed":
        hashes = [m.block_hash for m in ev.metas]
        if encoding == "map":
            return [{"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}]
        return [["BlockRemoved", hashes, medium]]
    out: list[Any] = []
    for m in ev.metas:
        tokens = list(m.token_ids)
        if encoding == "array":
            out.append(["BlockStored", [m.block_hash], m.parent_block_hash, tokens, m.block_size, m.lora_id, medium])
            continue
        doc: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [m.block_hash],
            "parent_block_hash": m.parent_block_hash,
            "token_ids": tokens,
            "block_size": m.block_size,
            "lora_id": m.lora_id,
            "medium": medium,
            "lora_name": m.lora_name,
        }
        if m.extra_keys is not None:
            doc["extra_keys"] = m.extra_keys
        out.append(doc)
    return out


def pack_batch(ts: float, events: list[Any]) -> bytes:
    return bytes(msgpack.packb([ts, events, None], use_bin_type=True))

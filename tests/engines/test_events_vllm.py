"""kvstore's ZMQ events decoded by vLLM's own classes
(``vllm.distributed.kv_events``): the current tagged-map encoding with
vLLM 0.32's ``KVEventBatch``, and the older array encoding with the classes
as vLLM before 0.10 declared them (what routers built then decode)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvstore.events.model import key_hash
from tests.engines.conftest import make_kvstore
from tests.http.conftest import ADMIN, free_port


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """vLLM 0.9's KVCacheEvent: arrays led by the tag."""


class OldBlockStored(OldEvent, tag="BlockStored"):  # type: ignore[call-arg]
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):  # type: ignore[call-arg]
    block_hashes: list[int]
    medium: str | None = None


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):  # type: ignore[call-arg]
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]
    data_parallel_rank: int | None = None


def _call(kv: Any, method: str, path: str, token: str, data: bytes | None = None) -> int:
    req = urllib.request.Request(kv.url + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return int(r.status)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_vllm_decodes_the_published_batches(tmp_path: Path, encoding: str) -> None:
    pub = f"tcp://127.0.0.1:{free_port()}"
    kv = make_kvstore(tmp_path / "kv", events_zmq=pub, events_encoding=encoding)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"engine")
    sub.connect(pub)
    try:
        for n in range(100):  # until the subscription has joined
            assert _call(kv, "PUT", f"/v1/blocks/warm{n}", kv.token, b"w") == 201
            if sub.poll(100):
                break
        else:
            raise AssertionError("the subscriber never connected")
        while sub.poll(300):
            sub.recv_multipart()
        assert _call(kv, "PUT", "/v1/blocks/k1", kv.token, b"x" * 100) == 201
        assert _call(kv, "DELETE", "/v1/blocks/k1", kv.token) == 204
        assert _call(kv, "DELETE", "/v1/admin/tenants/engine", ADMIN) == 204
        frames = [sub.recv_multipart() for _ in range(3)]
    finally:
        sub.close(linger=0)
        ctx.term()
        kv.stop()
    assert [f[0] for f in frames] == [b"engine"] * 3
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + 3))
    if encoding == "map":
        batches = [msgspec.msgpack.Decoder(type=KVEventBatch).decode(f[2]) for f in frames]
        kinds: tuple[type, ...] = (BlockStored, BlockRemoved, AllBlocksCleared)
    else:
        batches = [msgspec.msgpack.Decoder(type=OldBatch).decode(f[2]) for f in frames]
        kinds = (OldBlockStored, OldBlockRemoved, OldAllBlocksCleared)
    events = [b.events[0] for b in batches]
    assert [type(e) for e in events] == list(kinds)
    stored, removed, _ = events
    assert isinstance(stored, (BlockStored, OldBlockStored))
    assert stored.block_hashes == [key_hash("k1")] and stored.medium == "STORAGE" and stored.token_ids == []
    assert isinstance(removed, (BlockRemoved, OldBlockRemoved))
    assert removed.block_hashes == [key_hash("k1")]
    assert all(abs(b.ts - time.time()) < 60 for b in batches)

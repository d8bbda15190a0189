"""The daemon's batch body (transport/http/bodies.py BatchBody): blocks of
ALIGNED_MIN bytes or more are received into pooled page-aligned memory,
whatever the chunks the stream arrives in; smaller reads stay bytes; every
byte is held against the budget until the caller releases it, and a
cancelled put's memory is never handed out again."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp.base_protocol import BaseProtocol
from kvstore_client.wire.batchframe import encode_put_stream

from kvstore.buffers import POOL, address
from kvstore.config import StoreConfig
from kvstore.metrics import Metrics
from kvstore.qos.admission import Admission
from kvstore.qos.shares import BodyBudget
from kvstore.server_config import ServerConfig
from kvstore.transport import batchframe
from kvstore.transport.http.appkeys import CONFIG
from kvstore.transport.http.bodies import ALIGNED_MIN, BatchBody, Held
from kvstore.transport.http.qos import ADMISSION

MiB = 1 << 20


def _request(tmp_path: Path, data: bytes, chunk_sizes: list[int]) -> tuple[Any, BodyBudget]:
    loop = asyncio.get_running_loop()
    content = aiohttp.StreamReader(BaseProtocol(loop), 64 * MiB, loop=loop)  # fed whole: never pauses
    pos, i = 0, 0
    while pos < len(data):
        n = chunk_sizes[i % len(chunk_sizes)]
        content.feed_data(data[pos : pos + n])
        pos, i = pos + n, i + 1
    content.feed_eof()
    admission = Admission(Metrics(), 16, 64 * MiB, 0)
    app = {CONFIG: ServerConfig(store=StoreConfig(tmp_path)), ADMISSION: admission}
    budget = admission.budget
    # (no tenant on it: the gate did not run, the body is held against the total only)
    return SimpleNamespace(content=content, app=app, get=lambda key, default=None: default), budget


async def test_blocks_land_in_aligned_memory_whatever_the_chunks(tmp_path: Path) -> None:
    rng = random.Random(5)
    items = [(f"k{i}", rng.randbytes(n)) for i, n in enumerate([ALIGNED_MIN, 1, 300_001, ALIGNED_MIN - 1, 2 * MiB])]
    for chunks in ([1], [4096], [65_537, 13], [8 * MiB]):
        request, budget = _request(tmp_path, encode_put_stream(items), chunks if chunks != [1] else [997])
        body = BatchBody(request)
        got, helds = [], []
        async for key, data, _ in batchframe.read_put_items_meta(body, 4 * MiB, 16):
            got.append((key, bytes(data)))
            big = len(data) >= ALIGNED_MIN
            assert isinstance(data, memoryview) == big
            if big:
                assert address(data) % 4096 == 0
            helds.append(body.take())
        assert got == items
        # every byte read is held: the items' (framing included), then the end marker, not yet taken
        assert budget.used == sum(h.nbytes for h in helds) + 2 and sum(h.nbytes for h in helds) > sum(
            len(d) for _, d in items
        )
        assert sum(len(h.buffers) for h in helds) == 3
        for h in helds:
            body.release(h)
        body.close()
        assert budget.used == 0


async def test_a_cancelled_puts_memory_is_not_reused(tmp_path: Path) -> None:
    data = encode_put_stream([("k", b"x" * (2 * MiB))])
    request, budget = _request(tmp_path, data, [65_536])
    body = BatchBody(request)
    held: Held | None = None
    async for _key, _data, _ in batchframe.read_put_items_meta(body, 4 * MiB, 16):
        held = body.take()
    assert held is not None and len(held.buffers) == 1
    before = POOL.idle_bytes
    body.release(held, reuse=False)
    body.close()  # the end marker
    assert budget.used == 0 and POOL.idle_bytes == before
    taken = POOL.take(2 * MiB)
    assert taken is not held.buffers[0]
    taken.release()


async def test_a_short_stream_fails_and_holds_nothing(tmp_path: Path) -> None:
    data = encode_put_stream([("k", b"x" * (2 * MiB))])[:-(MiB)]
    request, budget = _request(tmp_path, data, [65_536])
    body = BatchBody(request)
    try:
        async for _ in batchframe.read_put_items_meta(body, 4 * MiB, 16):
            raise AssertionError("a truncated block was yielded")
    except Exception as e:  # noqa: BLE001 - the daemon's BadFraming
        assert "truncated stream" in str(e)
    body.close()
    assert budget.used == 0

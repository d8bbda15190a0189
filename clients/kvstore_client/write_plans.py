"""Write plans: store direct blocks by writing them into the daemon's
segment files from this process (``unix:PATH`` endpoints).

``POST /v1/write-plan`` reserves room for each block in the tenant's open
segment and passes the file's descriptor (write-only, a description of its
own); the blocks are written here with ``pwrite`` (``O_DIRECT`` where the
filesystem takes it: from page-aligned memory, no page-cache copy in either
process), then committed with each frame's xxh3-64. The daemon reads the
bytes back, checks them, and acknowledges after the same sync as a PUT.

A sealed tenant's blocks are planned with ``encode="client"`` when this
client encodes (``encode`` "client" or "auto", the decode extra installed):
the plan gives each record its id and its own frame key (never the tenant's
key), and the frames are compressed (the tenant's codec, as the daemon
would) and sealed here (AES-256-GCM, nonces and additional data of
kvstore_client/wire/sealing.py), on the decode threads; the commit gives
each frame's stored length, codec and xxh3-64, and the daemon checks every
tag before it indexes the record. With ``encode="server"`` (or without the
extra) a sealed tenant's blocks go over HTTP. So does any block of an
endpoint that cannot plan (a daemon without the route: remembered), and any
block a plan could not store.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import aiohttp
import xxhash

from kvstore_client.answers import NOT_ADMITTED, best, check, json_answer
from kvstore_client.bodies import BuffersPayload
from kvstore_client.errors import KVStoreClientError, ProtocolError, ServerError
from kvstore_client.exchange import Exchange
from kvstore_client.plans import PlanConnection
from kvstore_client.sharding import UNIX
from kvstore_client.wire.batchframe import BufferLike
from kvstore_client.wire.sealing import FrameBinding, frame_nonce

ALIGN = 4096
STAGE = 4 << 20  # an aligned bounce buffer, for sources that are not page-aligned
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
# Answers that say this endpoint will never plan writes for this client.
_NEVER = frozenset({"not_plannable", "unix_socket_required", "not_found"})


def frame_checksums(view: memoryview, frame_size: int) -> list[str]:
    """Each frame's xxh3-64, as the commit gives them (16 hex digits)."""
    return [
        f"{xxhash.xxh3_64_intdigest(view[i : i + frame_size]):016x}" for i in range(0, max(len(view), 1), frame_size)
    ]


def _aligned(view: memoryview) -> bool:
    """Whether ``view`` starts on a page boundary (only writable buffers can
    tell their address here; a read-only one is staged)."""
    if view.readonly or not len(view):
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


_local = threading.local()


def _stage() -> memoryview:
    """This thread's aligned bounce buffer (touched once, then reused)."""
    sv: memoryview | None = getattr(_local, "stage", None)
    if sv is None:
        sv = _local.stage = memoryview(mmap.mmap(-1, STAGE))
    return sv


def _set_direct(fd: int) -> bool:
    """O_DIRECT on our own description of the file; False where refused."""
    if not O_DIRECT:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    return True


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    views = [v for v in views if len(v)]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def write_block(fd: int, src: memoryview, offset: int, length: int, direct: bool) -> None:
    """Write ``src`` at ``offset``, then zeros up to ``length`` (an ALIGN
    multiple). With ``direct`` every write is aligned: a page-aligned source
    is written as it is, whole pages of it; the rest goes through an aligned
    bounce buffer (a memcpy is far cheaper than the page-cache copy it
    replaces)."""
    if not direct:
        _pwrite_all(fd, [src, memoryview(bytes(length - len(src)))], offset)
        return
    pos = 0
    if _aligned(src):
        pos = len(src) - len(src) % ALIGN
        _pwrite_all(fd, [src[:pos]], offset)
    sv = _stage()
    while pos < length:
        n = min(len(sv), length - pos)
        have = max(0, min(n, len(src) - pos))
        sv[:have] = src[pos : pos + have]
        if have < n:
            sv[have:n] = bytes(n - have)
        _pwrite_all(fd, [sv[:n]], offset + pos)
        pos += n


def seal_block(
    view: memoryview, plan: Mapping[str, Any], pool: Executor | None
) -> tuple[list[bytes], list[dict[str, Any]]]:
    """The stored frames of a block this client seals itself (``plan``: its
    write plan entry, with ``record``), and their entries for the commit."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvstore_client.wire.codec import encode_frame

    rec = plan["record"]
    fs = int(plan["frame_size"])
    count = int(rec["frame_count"])
    if count != -(-len(view) // fs):
        raise ProtocolError(f"write plan for {plan['key']}: {count} frames cannot hold {len(view)} bytes")
    binding = FrameBinding(
        bytes.fromhex(rec["record_id"]), int(rec["key_version"]), count, len(view), str(rec["tenant"]), plan["key"]
    )
    aead = AESGCM(base64.b64decode(rec["frame_key"]))
    codec, level = str(rec["compression"]), int(rec["level"])
    tried = {"none": "raw", "zstd": "zstd", "zstd-bp2": "zstd-bp2"}.get(codec, "raw")

    def one(i: int) -> tuple[bytes, dict[str, Any]]:
        name, encoded = encode_frame(view[i * fs : (i + 1) * fs], tried, level)  # type: ignore[arg-type]
        sealed = aead.encrypt(frame_nonce(i), bytes(encoded), binding.aad(i))
        return sealed, {"len": len(sealed), "codec": name, "xxh3": f"{xxhash.xxh3_64_intdigest(sealed):016x}"}

    done = list(pool.map(one, range(count))) if pool is not None and count > 1 else [one(i) for i in range(count)]
    return [d[0] for d in done], [d[1] for d in done]


def _on_gpu(buf: object) -> bool:
    return hasattr(buf, "__cuda_array_interface__")


def _nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    if not isinstance(n, int):
        raise KVStoreClientError("a GPU buffer must tell its size (nbytes)", code="invalid_input")
    return n


def _write_gpu(fd: int, buf: Any, offset: int, size: int) -> None:
    """``size`` bytes of GPU memory ``buf`` at ``offset`` of the file open
    as ``fd``, through kvikio (GPUDirect Storage where the driver has it,
    its own bounce buffers where not). The rest of the room stays zeros (the
    daemon allocated it)."""
    try:
        import kvikio  # type: ignore[import-not-found]
    except ImportError:
        raise KVStoreClientError(
            "a CUDA buffer needs kvikio (pip install 'kvstore-client[gds]')", code="gds_unavailable"
        ) from None
    # kvikio opens by path: the descriptor's own path reaches the same file
    # (the daemon passed it write-only; no permission on its directory needed).
    with kvikio.CuFile(f"/proc/self/fd/{fd}", "r+") as f:
        n = int(f.pwrite(buf, size, offset).get())
    if n != size:
        raise KVStoreClientError(f"wrote {n} of {size} bytes from GPU memory", code="gds_short_write")


def _asks(
    items: Sequence[tuple[str, BufferLike]],
    idx: list[int],
    sizes: Mapping[int, int],
    metas: Sequence[str | None] | None,
) -> list[dict[str, Any]]:
    """A plan's ``blocks``: each item's key, size and identity."""
    asks: list[dict[str, Any]] = []
    for i in idx:
        ask: dict[str, Any] = {"key": items[i][0], "size": sizes[i]}
        if metas is not None and metas[i] is not None:
            ask["meta"] = metas[i]
        asks.append(ask)
    return asks


def _settle(answer: Any, pos_of: Mapping[str, int], ok: list[int | None], stats: dict[str, int]) -> list[int]:
    """Each committed item's status from a commit's answer; the indices it did not store."""
    done: Mapping[str, Any] = {r["key"]: r for r in answer.get("blocks", ()) if isinstance(r, dict)}
    left: list[int] = []
    for key, i in pos_of.items():
        res = done.get(key)
        if res is not None and res.get("status") in (200, 201):
            ok[i] = best(ok[i], int(res["status"]))
            stats["plan_writes"] += 1
        else:
            left.append(i)
    return left


class UnixPlanWriter:
    """Puts through write plans on ``unix:`` endpoints: direct blocks, and a
    sealed tenant's when this client encodes (``client_encode``)."""

    def __init__(
        self,
        exchange: Exchange,
        *,
        enabled: bool,
        max_batch_keys: int,
        client_encode: bool = False,
        pool: Callable[[], Executor] | None = None,
    ) -> None:
        self._x = exchange
        self._enabled = enabled
        self._max_batch_keys = max_batch_keys
        self._client_encode = client_encode
        self._pool = pool
        self._refused: set[str] = set()  # endpoints that answered they never will

    def usable(self, url: str) -> bool:
        return self._enabled and url.startswith(UNIX) and url not in self._refused

    def _connection(self, url: str) -> PlanConnection:
        ep = self._x.endpoints[url]
        if ep.plans is None:
            ep.plans = PlanConnection(url[len(UNIX) :], ep.token, self._x.timeout)
        return ep.plans

    async def write(
        self,
        url: str,
        items: Sequence[tuple[str, BufferLike]],
        idx: list[int],
        ok: list[int | None],
        metas: Sequence[str | None] | None,
    ) -> list[int]:
        """Store ``items[idx]`` on ``url``; the indices left for HTTP."""
        left: list[int] = []
        for c in range(0, len(idx), self._max_batch_keys):
            part = idx[c : c + self._max_batch_keys]
            try:
                left += await asyncio.to_thread(self._plan_write_commit, url, items, part, ok, metas)
            except KVStoreClientError as e:
                if isinstance(e, ServerError) and e.code in _NEVER:
                    self._refused.add(url)
                self._x.log.warning("kvstore write plan failed, writing over HTTP: %s", e)
                left += part
        self._x.stats["plan_fallbacks"] += len(left)
        return left

    def _plan_write_commit(
        self,
        url: str,
        items: Sequence[tuple[str, BufferLike]],
        idx: list[int],
        ok: list[int | None],
        metas: Sequence[str | None] | None,
    ) -> list[int]:
        """On a thread: one plan for ``idx``'s blocks, their writes, the commit."""
        conn = self._connection(url)
        gpu = {i for i in idx if _on_gpu(items[i][1])}
        views = {i: memoryview(items[i][1]).cast("B") for i in idx if i not in gpu}
        sizes = {i: _nbytes(items[i][1]) if i in gpu else views[i].nbytes for i in idx}
        doc, fds = conn.plan_writes(_asks(items, idx, sizes, metas), encode="client" if self._client_encode else None)
        left: list[int] = []
        try:
            direct = [bool(doc.get("direct", True)) and _set_direct(fd) for fd in fds]
            by_key = {b["key"]: b for b in doc["blocks"]}
            commits: list[dict[str, Any]] = []
            pos_of: dict[str, int] = {}
            for i in idx:
                key = items[i][0]
                b = by_key.get(key)
                if b is not None and b.get("status") == NOT_ADMITTED:  # nothing to write, anywhere
                    ok[i] = best(ok[i], NOT_ADMITTED)
                    continue
                if b is None or b.get("status") != 200:
                    left.append(i)
                    continue
                if b.get("exists"):
                    ok[i] = best(ok[i], 200)
                    continue
                if int(b["size"]) != sizes[i]:
                    raise KVStoreClientError(f"write plan for {key} has size {b['size']}", code="protocol")
                f = int(b["file"])
                if i in gpu:  # GPUDirect Storage: GPU memory to the file, no host copy
                    if "record" in b:
                        raise KVStoreClientError(
                            f"block {key} is in GPU memory and its tenant is sealed: it is sealed on the CPU; "
                            "put it from host memory",
                            code="sealed_from_gpu",
                        )
                    _write_gpu(fds[f], items[i][1], int(b["offset"]), sizes[i])
                    # No host copy to take checksums from: the daemon takes them from what landed.
                    commits.append({"key": key, "xxh3": None})
                elif "record" in b:  # sealed here: the frames as stored, back to back
                    stored, frames = seal_block(views[i], b, self._pool() if self._pool is not None else None)
                    total = sum(len(x) for x in stored)
                    length = -(-total // ALIGN) * ALIGN
                    if length > int(b["length"]):
                        raise ProtocolError(f"write plan for {key}: {total} stored bytes exceed its room")
                    write_block(fds[f], memoryview(b"".join(stored)), int(b["offset"]), length, direct[f])
                    commits.append({"key": key, "frames": frames})
                else:
                    write_block(fds[f], views[i], int(b["offset"]), int(b["length"]), direct[f])
                    commits.append({"key": key, "xxh3": frame_checksums(views[i], int(b["frame_size"]))})
                pos_of[key] = i
        except BaseException:
            with contextlib.suppress(KVStoreClientError):
                conn.abandon_writes(doc["plan"])
            raise
        finally:
            for fd in fds:
                os.close(fd)
        if not commits:
            with contextlib.suppress(KVStoreClientError):
                conn.abandon_writes(doc["plan"])
            return left
        answer = conn.commit_writes(doc["plan"], commits)
        return left + _settle(answer, pos_of, ok, self._x.stats)


class UploadPlanWriter:
    """Puts of a sealed tenant's blocks sealed here, on an ``http(s)://``
    endpoint where a record's key may go (TLS, loopback): a write plan gives
    each record its id and key, the sealed frames go up as request bodies
    (``PUT /v1/write-plan/{plan}/blocks/{key}``), and the commit has the
    daemon check every tag. The daemon answers a direct tenant's plan over
    TCP with ``unix_socket_required``: that endpoint is remembered and its
    blocks go through ``/v1/batch/put``."""

    def __init__(self, exchange: Exchange, *, enabled: bool, pool: Callable[[], Executor]) -> None:
        self._x = exchange
        self._enabled = enabled
        self._pool = pool
        self._refused: set[str] = set()

    def usable(self, url: str) -> bool:
        from kvstore_client.decoding import decode_allowed

        return self._enabled and not url.startswith(UNIX) and url not in self._refused and decode_allowed(url)

    async def write(
        self,
        url: str,
        items: Sequence[tuple[str, BufferLike]],
        idx: list[int],
        ok: list[int | None],
        metas: Sequence[str | None] | None,
    ) -> list[int]:
        """Store ``items[idx]`` on ``url``; the indices left for HTTP PUTs."""
        try:
            return await self._plan_upload_commit(url, items, idx, ok, metas)
        except (KVStoreClientError, aiohttp.ClientError, OSError) as e:
            if isinstance(e, ServerError) and e.code in (*_NEVER, "insecure_transport"):
                self._refused.add(url)
            else:
                self._x.log.warning("kvstore write plan failed, writing over HTTP: %s", e)
            return idx

    async def _plan_upload_commit(
        self,
        url: str,
        items: Sequence[tuple[str, BufferLike]],
        idx: list[int],
        ok: list[int | None],
        metas: Sequence[str | None] | None,
    ) -> list[int]:
        s = self._x.session(self._x.endpoints[url])
        views = {i: memoryview(items[i][1]).cast("B") for i in idx}
        asks = _asks(items, idx, {i: v.nbytes for i, v in views.items()}, metas)
        async with s.post("/v1/write-plan", json={"blocks": asks, "encode": "client"}) as r:
            await check(r, ok=(200,))
            doc = await json_answer(r)
        plan = doc["plan"]
        by_key = {b["key"]: b for b in doc["blocks"]}
        left: list[int] = []
        commits: list[dict[str, Any]] = []
        pos_of: dict[str, int] = {}
        try:
            for i in idx:
                key = items[i][0]
                b = by_key.get(key)
                if b is not None and b.get("status") == NOT_ADMITTED:  # nothing to write, anywhere
                    ok[i] = best(ok[i], NOT_ADMITTED)
                    continue
                if b is None or b.get("status") != 200 or ("record" not in b and not b.get("exists")):
                    left.append(i)
                    continue
                if b.get("exists"):
                    ok[i] = best(ok[i], 200)
                    continue
                stored, frames = await asyncio.to_thread(seal_block, views[i], b, self._pool())
                body = BuffersPayload(stored, "application/octet-stream")
                async with s.put(f"/v1/write-plan/{plan}/blocks/{key}", data=body) as r:
                    await check(r, ok=(204,))
                commits.append({"key": key, "frames": frames})
                pos_of[key] = i
        except BaseException:
            with contextlib.suppress(Exception):
                async with s.delete(f"/v1/write-plan/{plan}"):
                    pass
            raise
        if not commits:
            async with s.delete(f"/v1/write-plan/{plan}"):
                pass
            return left
        async with s.post(f"/v1/write-plan/{plan}", json={"blocks": commits}) as r:
            await check(r, ok=(200,))
            answer = await json_answer(r)
        return left + _settle(answer, pos_of, ok, self._x.stats)

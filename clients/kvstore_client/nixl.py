"""Reads and writes over NIXL: the bytes move one-sided between this
process's agent and the daemon's (RDMA where there is a NIC, UCX over TCP
otherwise), not through HTTP bodies.

``pip install --no-deps nixl-cu12 nixl`` (its wheel declares torch, which
would pull a CUDA stack; host memory needs none of it). A read: ``POST
/v1/xfer/read`` answers where the block is in the daemon's agent under a
lease, this agent READs it into the caller's buffer (registered once, host
memory or a CUDA buffer as VRAM) and checks the frames' xxh3 the answer
listed; the lease's release rides on the next read (or goes after 50 ms).
A CUDA buffer cannot be hashed here: ``POST /v1/xfer/release`` confirms
first that the lease still held when the READ was done (``404``: it
expired, the bytes are discarded and the caller reads over HTTP). Many keys
take one control call and one transfer (``get_many_into``).

Descriptor lists are built per transfer (``initialize_xfer``), not prepared
once: the daemon's side changes with every answer, and building both sides
measured 6 µs for one descriptor and 11 µs for 32 here, against about a
millisecond for the control call. A write: values are
copied into a registered buffer and ``POST /v1/xfer/write`` makes the daemon
READ them. Any failure raises :class:`NixlFallback`: the client then uses
HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
import xxhash

from kvstore_client.errors import BufferTooSmall
from kvstore_client.wire.nixl_loader import configure_ucx, make_agent, nixl_api

PROGRESS_DELAY_US = 100  # the progress thread's sleep between polls (NIXL's wrapper uses 0: a spinning core)
POLL_S = (0.01, 0.002)  # poll without sleeping this long after a transfer starts or ends; then sleep up to this
MAX_REGISTERED = 256  # caller buffers kept registered (least recently used go first)
INLINE_VERIFY_BYTES = 4 << 20  # READ bytes checked on the event loop; more go to a thread
RELEASE_AFTER_S = 0.05  # a verified read's lease waits this long for the next read to carry its release
MAX_RELEASES = 256  # leases released by one call


class NixlFallback(Exception):
    """This transfer cannot go over NIXL: use HTTP. ``permanent``: the daemon
    has no NIXL agent (do not ask it again)."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class _NotLoaded(NixlFallback):
    """A transfer names daemon memory whose metadata this agent has not
    loaded yet: another read's answer, still on its way, carries it."""


def nixl_available() -> bool:
    try:
        nixl_api()
    except ImportError:
        return False
    return True


def _rdma_devices() -> list[str]:
    """The host's RDMA devices as the kernel lists them."""
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []


def _where(buf: Any) -> tuple[int, int, str, int]:
    """(address, bytes, memory type, device) of a writable contiguous buffer."""
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        n = int(getattr(buf, "nbytes", 0))
        device = getattr(buf, "device", None)
        dev = int(getattr(device, "index", None) or getattr(device, "id", 0) or 0)
        return int(cai["data"][0]), n, "VRAM", dev
    mv = memoryview(buf).cast("B")
    if mv.readonly:
        raise TypeError("the buffer is read-only")
    n = mv.nbytes
    if n == 0:
        return 0, 0, "DRAM", 0
    return ctypes.addressof(ctypes.c_char.from_buffer(mv)), n, "DRAM", 0


class NixlAgent:
    """This process's NIXL agent, shared by the endpoints of one client.
    Event-loop only."""

    def __init__(self, name: str | None = None, backend: str = "UCX", devices: str | None = None) -> None:
        configure_ucx(devices or None, rdma=bool(_rdma_devices()))
        self.name = name or f"kvstore-client-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = make_agent(self.name, backend, PROGRESS_DELAY_US)
        # Registered caller buffers, oldest first, each with the buffer itself: held, so
        # its memory cannot be freed and reused by another object while registered.
        self._regs: dict[tuple[int, int, str, int], tuple[Any, Any]] = {}
        self._pinned: dict[tuple[int, int, str, int], int] = {}  # registrations a transfer in flight uses
        self._daemons: dict[str, str] = {}  # endpoint -> the daemon's agent name
        self._bounce: tuple[bytearray, Any] | None = None  # (bytearray, registration) for writes
        self._bounce_new = False  # registered since the daemon last got our metadata
        self._write_lock = asyncio.Lock()
        self._poller = _Poller(self.agent)
        # Read calls in flight per endpoint; the daemon sends a region's metadata once, in
        # one answer, and another answer naming that region may arrive before it.
        self._asking: dict[str, int] = {}
        self._loaded = asyncio.Event()  # set (and replaced) whenever an answer's metadata is loaded
        self._pending: dict[str, list[str]] = {}  # endpoint -> leases of verified reads, to release
        self._flushing: dict[str, asyncio.Task[None]] = {}

    def close(self) -> None:
        self._poller.close()
        for task in self._flushing.values():
            task.cancel()
        self._flushing.clear()
        for reg, _ in self._regs.values():
            self.agent.deregister_memory(reg)
        self._regs.clear()
        if self._bounce is not None:
            self.agent.deregister_memory(self._bounce[1])
            self._bounce = None
        # The agent goes now, while UCX is whole: left to the interpreter's exit,
        # its teardown crashed the process (SIGSEGV after the last test).
        self.agent = None

    # -- control calls ------------------------------------------------------------

    async def _post(self, s: aiohttp.ClientSession, path: str, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        async with s.post(path, json=doc) as r:
            body = await r.read()
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {}
        return r.status, parsed if isinstance(parsed, dict) else {}

    async def _daemon(self, s: aiohttp.ClientSession, url: str, again: bool = False) -> str:
        name = self._daemons.get(url)
        if name is not None and not again:
            return name
        meta = base64.b64encode(self.agent.get_agent_metadata()).decode()
        status, doc = await self._post(s, "/v1/xfer/agents", {"name": self.name, "metadata": meta})
        _check(status, doc, "registering the agent")
        try:
            loaded = self.agent.add_remote_agent(base64.b64decode(doc["metadata"]))
        except Exception as e:  # noqa: BLE001 - NIXL's errors for bad metadata
            raise NixlFallback(f"the daemon's agent metadata does not load: {e}") from None
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._daemons[url] = name
        self._bounce_new = False  # the full metadata just sent covers the bounce buffer
        return name

    async def _call(
        self, s: aiohttp.ClientSession, url: str, path: str, doc: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """A control call naming our agent; re-registers once when the
        daemon does not know it (it restarted)."""
        daemon = await self._daemon(s, url)
        status, answer = await self._post(s, path, doc)
        if status == 409 and _code(answer) == "agent_unknown":
            daemon = await self._daemon(s, url, again=True)
            status, answer = await self._post(s, path, doc)
        _check(status, answer, path)
        return daemon, answer

    # -- reads ----------------------------------------------------------------------

    async def read_many(
        self, s: aiohttp.ClientSession, url: str, keys: list[str], bufs: list[Any], deadline: float
    ) -> list[int | Exception | None]:
        """Read ``keys[i]`` into ``bufs[i]`` over NIXL: each key's size, None
        for a miss, or the error that sends it to HTTP (:class:`NixlFallback`,
        :class:`BufferTooSmall`). One control call and one transfer per
        memory type for the batch. Host buffers are verified against the
        frames' xxh3, so the lease is released later, on the next read;
        CUDA buffers cannot be hashed here: their lease is confirmed first."""
        where = [_where(b) for b in bufs]
        verify = all(mem == "DRAM" for _, _, mem, _ in where)
        doc: dict[str, Any] = {"agent": self.name, "keys": keys, "checksums": verify}
        done = self._take_releases(url)
        if done:
            doc["release"] = done
        self._asking[url] = self._asking.get(url, 0) + 1
        try:
            daemon, answer = await self._call(s, url, "/v1/xfer/read", doc)
        finally:
            self._asking[url] -= 1
        lease = str(answer.get("lease", ""))
        blocks = answer.get("blocks")
        if not isinstance(blocks, list) or len(blocks) != len(keys):
            await self._release(s, lease, quiet=True)
            raise NixlFallback("the daemon's read answer does not list every key")
        out: list[int | Exception | None] = [None] * len(keys)
        # (memory type, device) -> (index, local addr, remote addr, len, remote dev)
        moves: dict[tuple[str, int], list[tuple[int, int, int, int, int]]] = {}
        pins: list[tuple[int, int, str, int]] = []
        try:
            if answer.get("metadata"):
                self.agent.add_remote_agent(base64.b64decode(answer["metadata"]))
                self._loaded.set()
                self._loaded = asyncio.Event()
            for i, (key, b, buf, (addr, cap, mem, dev)) in enumerate(zip(keys, blocks, bufs, where, strict=True)):
                status = b.get("status") if isinstance(b, dict) else None
                if status == 404:
                    continue
                if status != 200:
                    out[i] = NixlFallback(f"the daemon cannot serve {key} over NIXL: {_code(b)}")
                    continue
                n = int(b["len"])
                out[i] = n
                if n > cap:
                    out[i] = BufferTooSmall(f"block {key} is {n} bytes; the buffer holds {cap}")
                elif n:
                    pins.append(self._register(buf, addr, cap, mem, dev, pin=True))
                    moves.setdefault((mem, dev), []).append((i, addr, int(b["addr"]), n, int(b["dev"])))
            for (mem, dev), spans in moves.items():
                local = [(a, n, dev) for _, a, _, n, _ in spans]
                remote = [(r, n, d) for _, _, r, n, d in spans]
                await self._read(url, daemon, local, remote, mem, deadline)
        except BaseException:
            await self._release(s, lease, quiet=True)
            raise
        finally:
            self._unpin(pins)
        if not verify:
            if lease and not await self._release(s, lease):
                raise NixlFallback("the lease expired before its READs were confirmed: read again")
            return out
        self._later(s, url, lease)
        checks = [(i, n) for spans in moves.values() for i, _, _, n, _ in spans]

        def failed() -> list[int]:
            return [i for i, n in checks if not _frames_match(bufs[i], n, blocks[i])]

        # Hashed here while small; a large batch on a thread, not holding up the loop.
        bad = failed() if sum(n for _, n in checks) <= INLINE_VERIFY_BYTES else await asyncio.to_thread(failed)
        for i in bad:
            out[i] = NixlFallback(f"block {keys[i]}: what was READ fails its checksum (the lease expired?)")
        return out

    async def _read(
        self,
        url: str,
        daemon: str,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        mem: str,
        deadline: float,
    ) -> None:
        """A READ that waits, while other read calls are in flight, for the
        metadata of the daemon's memory it names (sent in one of their answers)."""
        while True:
            try:
                return await self._transfer("READ", daemon, local, remote, mem, deadline)
            except _NotLoaded:
                if not self._asking.get(url):
                    raise
                try:
                    await asyncio.wait_for(self._loaded.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise NixlFallback("the daemon's metadata for a READ never came") from None

    def _take_releases(self, url: str) -> list[str]:
        pending = self._pending.get(url)
        if not pending:
            return []
        taken, self._pending[url] = pending[:MAX_RELEASES], pending[MAX_RELEASES:]
        return taken

    def _later(self, s: aiohttp.ClientSession, url: str, lease: str) -> None:
        """Release ``lease`` with the next read, or after RELEASE_AFTER_S without one."""
        if not lease:
            return
        self._pending.setdefault(url, []).append(lease)
        task = self._flushing.get(url)
        if task is None or task.done():
            self._flushing[url] = asyncio.get_running_loop().create_task(self._flush_after(s, url))

    async def _flush_after(self, s: aiohttp.ClientSession, url: str) -> None:
        await asyncio.sleep(RELEASE_AFTER_S)
        await self.flush(s, url)

    async def flush(self, s: aiohttp.ClientSession, url: str) -> None:
        """Release the leases still pending on ``url`` now."""
        while leases := self._take_releases(url):
            with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):  # they expire anyway
                await self._post(s, "/v1/xfer/release", {"leases": leases})

    async def _release(self, s: aiohttp.ClientSession, lease: str, quiet: bool = False) -> bool:
        """Whether the lease still held (the bytes READ under it are the block's)."""
        if not lease:
            return True
        try:
            status, doc = await self._post(s, "/v1/xfer/release", {"lease": lease})
        except (TimeoutError, aiohttp.ClientError):
            if quiet:
                return False
            raise
        if status == 204:
            return True
        if status == 404 or quiet:
            return False
        _check(status, doc, "releasing the lease")
        return False

    # -- writes ---------------------------------------------------------------------

    async def write(
        self,
        s: aiohttp.ClientSession,
        url: str,
        items: list[tuple[str, memoryview]],
        metas: list[Mapping[str, Any] | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Store ``items`` through the daemon's READs of a registered copy
        (``metas``: each block's engine identity, or None)."""
        async with self._write_lock:  # one bounce buffer
            await self._daemon(s, url)
            total = sum(v.nbytes for _, v in items)
            buf = self._bounce_of(total)
            base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            blocks, at = [], 0
            for i, (key, v) in enumerate(items):
                buf[at : at + v.nbytes] = v
                block: dict[str, Any] = {"key": key, "addr": base + at, "len": v.nbytes, "dev": 0}
                if metas is not None and metas[i] is not None:
                    block["meta"] = dict(metas[i] or {})
                blocks.append(block)
                at += v.nbytes
            doc: dict[str, Any] = {"agent": self.name, "blocks": blocks}
            if self._bounce_new and self._bounce is not None:
                md = self.agent.get_partial_agent_metadata(self._bounce[1], True)
                doc["metadata"] = base64.b64encode(md).decode()
            _, answer = await self._call(s, url, "/v1/xfer/write", doc)
            self._bounce_new = False
            results = answer.get("results")
            if not isinstance(results, list) or len(results) != len(items):
                raise NixlFallback("the daemon's write answer does not list every block")
            return results

    def _bounce_of(self, n: int) -> bytearray:
        if self._bounce is None or len(self._bounce[0]) < n:
            if self._bounce is not None:
                self.agent.deregister_memory(self._bounce[1])
            size = max(n, 1 << 20, 2 * len(self._bounce[0]) if self._bounce else 0)
            buf = bytearray(size)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            self._bounce = (buf, self.agent.register_memory([(addr, size, 0, "")], "DRAM"))
            self._bounce_new = True
        return self._bounce[0]

    # -- memory and transfers -------------------------------------------------------

    def _register(
        self, obj: Any, addr: int, n: int, mem: str, dev: int, pin: bool = False
    ) -> tuple[int, int, str, int]:
        """Register a caller's buffer once (kept, with ``obj``, for later
        calls); the registration covering it. ``pin``: not let go until
        ``_unpin`` (a transfer in flight uses it)."""
        key = (addr, n, mem, dev)
        if key in self._regs:
            self._regs[key] = self._regs.pop(key)  # most recently used last
        else:
            for k in self._regs:
                a, m, kind, d = k
                if kind == mem and d == dev and a <= addr and addr + n <= a + m:
                    key = k
                    break
            else:
                self._regs[key] = (self.agent.register_memory([(addr, n, dev, "")], mem), obj)
        if pin:
            self._pinned[key] = self._pinned.get(key, 0) + 1
        self._trim()
        return key

    def _unpin(self, keys: list[tuple[int, int, str, int]]) -> None:
        for key in keys:
            left = self._pinned[key] - 1
            if left:
                self._pinned[key] = left
            else:
                del self._pinned[key]
        self._trim()

    def _trim(self) -> None:
        """Let the least recently used registrations go, down to
        MAX_REGISTERED, except those in use (a batch may hold more)."""
        excess = len(self._regs) - MAX_REGISTERED
        for key in [k for k in self._regs if k not in self._pinned][: max(excess, 0)]:
            self.agent.deregister_memory(self._regs.pop(key)[0])

    async def _transfer(
        self,
        op: str,
        daemon: str,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        mem: str,
        deadline: float,
    ) -> None:
        agent = self.agent
        try:
            handle = agent.initialize_xfer(
                op, agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, "DRAM"), daemon
            )
        except Exception as e:  # noqa: BLE001 - NIXL's errors: descriptors, a peer gone
            if type(e).__name__ == "nixlNotFoundError":
                raise _NotLoaded(f"the NIXL {op} could not start: {e}") from None
            raise NixlFallback(f"the NIXL {op} could not start: {e}") from None
        try:
            state = agent.transfer(handle)
            if state == "PROC":
                try:
                    state = await asyncio.wait_for(self._poller.wait(handle), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise NixlFallback(f"the NIXL {op} did not finish within the deadline") from None
            if state != "DONE":
                raise NixlFallback(f"the NIXL {op} failed")
        except NixlFallback:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the daemon went away mid-transfer
            raise NixlFallback(f"the NIXL {op} failed: {e}") from None
        finally:
            self._poller.forget(handle)
            with contextlib.suppress(Exception):  # a transfer that cannot be cancelled keeps its handle
                handle.release()


class _Poller:
    """One task on the event loop polls every transfer in flight. Checking a
    transfer also progresses UCX, so a tight poll is what makes a READ fast
    (a 16 MiB READ took 7 ms polled in a loop, 10 ms polled from a thread
    every 50 µs, 11 ms with millisecond sleeps: the loop's timers tick in
    milliseconds); one task for all, so at most one spins however many are
    outstanding (each spinning on its own took the cores the transfers
    needed). It yields without sleeping while transfers start or end within
    POLL_S[0] of each other, then sleeps between polls, up to POLL_S[1]."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._waiting: dict[int, tuple[Any, asyncio.Future[str]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._busy = 0.0  # when a transfer last started or ended

    def wait(self, handle: Any) -> asyncio.Future[str]:
        """The transfer's final state (DONE or ERR), when it has one."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting[id(handle)] = (handle, fut)
        self._busy = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return fut

    def forget(self, handle: Any) -> None:
        """Stop polling ``handle`` (before it is released)."""
        self._waiting.pop(id(handle), None)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        delay = 0.0
        while self._waiting:
            now = time.monotonic()
            for key, (handle, fut) in list(self._waiting.items()):
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception:  # noqa: BLE001 - e.g. the peer went away
                    state = "ERR"
                if state != "PROC":
                    del self._waiting[key]
                    if not fut.done():
                        fut.set_result(state)
                    self._busy = now
            delay = 0.0 if now - self._busy < POLL_S[0] else min(max(delay * 2, 0.0005), POLL_S[1])
            await asyncio.sleep(delay)


def _frames_match(buf: Any, n: int, block: dict[str, Any]) -> bool:
    """Whether the first ``n`` bytes of ``buf`` have the frames' xxh3 the
    daemon listed (``frame_size``, ``xxh3``: hex per frame)."""
    try:
        fs = int(block["frame_size"])
        want = [int(h, 16) for h in block["xxh3"]]
    except (KeyError, TypeError, ValueError):
        return False
    if fs <= 0 or len(want) != -(-n // fs):
        return False
    mv = memoryview(buf).cast("B")[:n]
    return all(xxhash.xxh3_64_intdigest(mv[i * fs : (i + 1) * fs]) == w for i, w in enumerate(want))


def _code(doc: dict[str, Any]) -> str:
    err = doc.get("error")
    return str(err.get("code", "")) if isinstance(err, dict) else ""


def _check(status: int, doc: dict[str, Any], what: str) -> None:
    if status == 200:
        return
    code = _code(doc)
    raise NixlFallback(f"{what}: {status} {code}".strip(), permanent=code == "nixl_disabled")

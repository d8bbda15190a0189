"""NIXL transfers: peers, read leases, reads and writes.

- A peer (a client's agent) is introduced once per tenant with its metadata
  (``register``); its name is then bound to that tenant: another tenant
  cannot use or replace it.
- ``read`` answers where each block's plaintext is in the daemon's agent:
  direct blocks in their segment's registered mapping (frames verified
  first), others (sealed, object tier only, or failing a check) decoded by
  the store into a staging piece. A lease pins the segments (no compaction,
  no drop) and the pieces until ``release`` or expiry. The answer carries
  the partial metadata of the regions the peer has not been sent yet.
  With ``checksums``, each block carries the xxh3-64 of its frames and the
  client verifies what it READ instead of the daemon verifying first: the
  client then needs no confirmation that the lease held (a READ of memory
  reused after expiry fails its checksum), so its release can wait and ride
  on its next read (``release``).
- ``write`` of a direct tenant's blocks: a write plan reserves room for
  each in the tenant's open segment (engine/store_write_plans.py), the
  daemon READs each block straight into the file's pages there (a landing:
  the reserved range mapped shared, registered for this transfer only),
  takes each frame's xxh3-64 of what landed and commits the plan: synced
  and indexed as a PUT would be (first write wins, same durability), with
  no staging copy and no put. A sealed tenant's blocks (the daemon seals
  them) are READ into staging and stored each as a PUT.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash
from kvstore_client.wire.nixl_loader import configure_ucx

from kvstore.engine.api import PlannedBlock, Store, Stored
from kvstore.errors import (
    AgentTaken,
    AgentUnknown,
    InvalidInput,
    KVStoreError,
    LeaseNotFound,
    NotFound,
    TenantNotFound,
    TransferFailed,
)
from kvstore.events.model import BlockMeta
from kvstore.names import validate_client_key
from kvstore.server_config import ServerConfig
from kvstore.transport.nixl.agent import make_agent, ucx_devices
from kvstore.transport.nixl.devices import Discovery
from kvstore.transport.nixl.memory import Memory, Piece, Region, view
from kvstore.transport.statuses import http_status, item_answer

log = logging.getLogger("kvstore.nixl")
INLINE_VERIFY_BYTES = 4 << 20  # blocks up to this size are checked on the event loop
POLL_S = (0.002, 0.005)  # a transfer is polled without sleeping this long, then sleeping up to this


@dataclass
class Peer:
    tenant: str
    name: str
    known: set[int] = field(default_factory=set)  # regions whose metadata it was sent


@dataclass
class XferLease:
    id: str
    tenant: str
    expires: float
    regions: list[Region] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)


def _sys_rdma() -> bool:
    """Whether the kernel lists RDMA devices (pyverbs may be missing)."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _frame_sums(data: memoryview, frame_size: int) -> list[int]:
    return [xxhash.xxh3_64_intdigest(data[i : i + frame_size]) for i in range(0, len(data), frame_size)]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class XferService:
    """The daemon's NIXL agent and what it serves. Event-loop only."""

    def __init__(self, store: Store, config: ServerConfig, found: Discovery) -> None:
        self._store = store
        self._config = config
        self.devices = ucx_devices(config.nixl_devices, found)
        configure_ucx(self.devices, rdma=bool(found.ports) or _sys_rdma())
        self.name = f"kvstore-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = make_agent(self.name, config.nixl_backend)
        self.memory = Memory(self.agent, config.nixl_staging_bytes)
        self._peers: dict[str, Peer] = {}
        self._leases: dict[str, XferLease] = {}
        # A fleet node: the store of a dead node it took over that holds a key it misses (routes/fleet.py).
        self.adopted: Callable[[str, str], Store | None] | None = None
        self.counts = {"reads": 0, "read_bytes": 0, "staged_bytes": 0, "writes": 0, "write_bytes": 0}
        log.info("NIXL agent %s (backend %s, UCX devices %s)", self.name, config.nixl_backend, self.devices or "UCX's")

    # -- peers ------------------------------------------------------------------

    def register(self, tenant: str, name: str, metadata: bytes) -> bytes:
        """Load a peer's metadata; returns the daemon's connection metadata."""
        peer = self._peers.get(name)
        if peer is not None and peer.tenant != tenant:
            raise AgentTaken(f"agent name {name!r} is registered by another tenant; choose a unique name")
        if peer is not None or name == self.name:
            self._forget(name)
        loaded = self._load(metadata, "metadata")
        if loaded != name:
            self._forget(loaded)
            raise InvalidInput(f"field 'metadata' describes agent {loaded!r}, not {name!r} (field 'name')")
        self._peers[name] = Peer(tenant, name)
        return self.memory.metadata([])

    def _peer(self, tenant: str, name: str) -> Peer:
        peer = self._peers.get(name)
        if peer is None or peer.tenant != tenant:
            raise AgentUnknown(f"agent {name!r} is not registered for this tenant: POST /v1/xfer/agents first")
        return peer

    def _load(self, metadata: bytes, what: str) -> str:
        try:
            loaded = self.agent.add_remote_agent(metadata)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types for bad metadata
            raise InvalidInput(f"field {what!r} is not NIXL agent metadata: {type(e).__name__}") from None
        return loaded.decode() if isinstance(loaded, bytes) else str(loaded)

    def _forget(self, name: str) -> None:
        self._peers.pop(name, None)
        with contextlib.suppress(Exception):  # not loaded: nothing to forget
            self.agent.remove_remote_agent(name)

    # -- reads ------------------------------------------------------------------

    async def read(
        self, tenant: str, agent: str, keys: list[str], checksums: bool = False, release: list[str] | None = None
    ) -> dict[str, Any]:
        peer = self._peer(tenant, agent)
        for lease_id in release or ():
            self.release_quietly(tenant, lease_id)
        lease = XferLease(uuid.uuid4().hex, tenant, time.monotonic() + self._config.nixl_lease_s)
        store = self._store
        planned = await store.plan_reads(tenant, keys)
        blocks: list[dict[str, Any]] = []
        segments: set[tuple[str, int]] = set()
        try:
            for key, p in zip(keys, planned, strict=True):
                try:
                    blocks.append(await self._read_one(tenant, key, p, lease, segments, checksums))
                except KVStoreError as e:
                    blocks.append({"key": key, "status": http_status(e), "error": {"code": e.code, "message": str(e)}})
            if segments:
                store.leases.acquire(segments, self._config.nixl_lease_s, lease.id)
        except BaseException:
            self._end(lease)
            raise
        finally:
            for p in planned:
                if isinstance(p, PlannedBlock):
                    p.segment.release()
        self._leases[lease.id] = lease
        regions = [r for r in {id(r): r for r in [*lease.regions, *(p.region for p in lease.pieces)]}.values()]
        new = [r for r in regions if r.id not in peer.known]
        peer.known.update(r.id for r in new)
        self.counts["reads"] += 1
        return {
            "lease": lease.id,
            "expires_in_s": self._config.nixl_lease_s,
            "mem": "DRAM",
            "metadata": b64(self.memory.metadata(new)) if new else "",
            "blocks": blocks,
        }

    async def _read_one(
        self,
        tenant: str,
        key: str,
        p: PlannedBlock | KVStoreError,
        lease: XferLease,
        segments: set[tuple[str, int]],
        checksums: bool,
    ) -> dict[str, Any]:
        source = self._store
        if isinstance(p, NotFound):
            other = self.adopted(tenant, key) if self.adopted is not None else None
            if other is None or isinstance(p, TenantNotFound):
                raise p
            source = other  # a dead node's block, read from the bucket and staged
        elif isinstance(p, PlannedBlock) and p.record is None:
            region = self.memory.segment(tenant, p.file, p.segment.fd, p.offset + p.size)
            if checksums or await self._verified(region, p):
                self.memory.hold(region, lease.id)
                lease.regions.append(region)
                segments.add((p.file[0], p.file[2]))
                self.counts["read_bytes"] += p.size
                self._store.metrics.inc("kvstore_nixl_bytes_total", p.size, op="read", source="mapping")
                addr = region.addr + p.offset
                answer = {"key": key, "status": 200, "size": p.size, "addr": addr, "len": p.size, "dev": 0}
                if checksums:
                    answer |= {"frame_size": p.frame_size, "xxh3": [f"{c:016x}" for c in p.checksums]}
                return answer
            log.warning("NIXL read of %s: a frame fails its checksum in the mapping; read through the store", key)
        # Sealed, in the object tier only, moved, failing a check, or taken over: the store's own read path.
        data = await source.get_buffer(tenant, key)
        n = len(data)
        piece = self.memory.stage(tenant, n)
        lease.pieces.append(piece)
        piece.view(n)[:] = data
        self.counts["read_bytes"] += n
        self._store.metrics.inc("kvstore_nixl_bytes_total", n, op="read", source="staging")
        self.counts["staged_bytes"] += n
        answer = {"key": key, "status": 200, "size": n, "addr": piece.addr, "len": n, "dev": 0}
        if checksums:  # one frame: the plaintext as staged
            digest = (
                xxhash.xxh3_64_intdigest(data)
                if n <= INLINE_VERIFY_BYTES
                else await asyncio.to_thread(xxhash.xxh3_64_intdigest, data)
            )
            answer |= {"frame_size": max(n, 1), "xxh3": [f"{digest:016x}"] if n else []}
        return answer

    async def _verified(self, region: Region, p: PlannedBlock) -> bool:
        def check() -> bool:
            data = view(region.addr + p.offset, p.size)
            fs = p.frame_size
            return all(
                xxhash.xxh3_64_intdigest(data[i * fs : min((i + 1) * fs, p.size)]) == want
                for i, want in enumerate(p.checksums)
            )

        return check() if p.size <= INLINE_VERIFY_BYTES else await asyncio.to_thread(check)

    def release(self, tenant: str, lease_id: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.tenant != tenant or lease.expires <= time.monotonic():
            raise LeaseNotFound("no such NIXL lease (released, expired, or never given): discard what was read")
        del self._leases[lease_id]
        self._end(lease)

    def release_quietly(self, tenant: str, lease_id: str) -> None:
        """End a lease if it is this tenant's and still held; else nothing."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.tenant == tenant:
            del self._leases[lease_id]
            self._end(lease)

    def _end(self, lease: XferLease) -> None:
        self._store.leases.release(lease.id)
        for r in lease.regions:
            self.memory.let_go(r, lease.id)
        for piece in lease.pieces:
            self.memory.free(piece)
        lease.regions.clear()
        lease.pieces.clear()

    def sweep(self) -> None:
        """End expired leases; let the memory of gone segments go."""
        now = time.monotonic()
        for lid in [lid for lid, lease in self._leases.items() if lease.expires <= now]:
            self._end(self._leases.pop(lid))
        self.memory.sweep(lambda f: self._store.segment_alive(*f))

    # -- writes -----------------------------------------------------------------

    async def write(
        self,
        tenant: str,
        agent: str,
        metadata: bytes | None,
        blocks: list[tuple[str, int, int, int]],
        metas: list[BlockMeta | None] | None = None,
    ) -> list[dict[str, Any]]:
        """READ ``blocks`` (key, addr, len, dev) from the peer and put them
        (``metas``: their engine identities, or None)."""
        self._peer(tenant, agent)
        if metadata:
            loaded = self._load(metadata, "metadata")
            if loaded != agent:
                raise InvalidInput(f"field 'metadata' describes agent {loaded!r}, not {agent!r} (field 'agent')")
        if blocks and self._store.plans_writes(tenant):
            return await self._write_planned(tenant, agent, blocks, metas)
        total = sum(n for _, _, n, _ in blocks)
        piece = self.memory.stage(tenant, max(total, 1))
        try:
            spans, at = [], 0
            for _, addr, n, dev in blocks:
                spans.append((at, addr, n, dev))
                at += n
            moving = [(piece.addr + off, addr, n, dev) for off, addr, n, dev in spans if n]
            if moving:
                await self._transfer("READ", agent, moving)
            results: list[dict[str, Any]] = []
            data = piece.view()
            ids = metas if metas is not None else [None] * len(blocks)
            for (key, _, n, _), (off, *_rest), meta in zip(blocks, spans, ids, strict=True):
                try:
                    created = (
                        await self._store.put(tenant, validate_client_key(key), data[off : off + n], meta)
                    ).created
                    results.append({"key": key, "status": 201 if created else 200, "size": n, "created": created})
                except KVStoreError as e:  # NotAdmitted among them: a 202 item (the bytes were pulled, not written)
                    results.append(item_answer(key, e))
            self.counts["writes"] += 1
            self.counts["write_bytes"] += total
            self._store.metrics.inc("kvstore_nixl_bytes_total", total, op="write", source="staging")
            return results
        finally:
            self.memory.free(piece)

    async def _write_planned(
        self,
        tenant: str,
        agent: str,
        blocks: list[tuple[str, int, int, int]],
        metas: list[BlockMeta | None] | None,
    ) -> list[dict[str, Any]]:
        """A direct tenant's write: READ into the room a write plan reserved."""
        keys = [validate_client_key(key) for key, _, _, _ in blocks]
        if len(set(keys)) != len(keys):
            raise InvalidInput("a key appears twice in one write (field 'blocks')")
        ids = {k: m for k, m in zip(keys, metas, strict=True) if m is not None} if metas is not None else None
        store = self._store
        empty = InvalidInput("block is empty; blocks are 1 byte or more")
        items = [(k, n) for k, (_, _, n, _) in zip(keys, blocks, strict=True) if n > 0]
        plan = await store.plan_writes(tenant, items, min(self._config.request_timeout_s + 5, 600.0), ids)
        landings: list[tuple[str, Region]] = []
        committed = False
        done: dict[str, Stored | KVStoreError] = {}
        try:
            spans = []
            for key, (_, addr, n, dev) in zip(keys, blocks, strict=True):
                w = plan.writes.get(key)
                if w is None:
                    continue  # stored already
                region = self.memory.landing(tenant, w.reservation.segment.fd, w.offset, w.length)
                landings.append((key, region))
                spans.append((region.addr, addr, n, dev))
            if spans:
                await self._transfer("READ", agent, spans)
            sums: dict[str, list[int]] = {}
            for key, r in landings:
                w = plan.writes[key]
                sums[key] = await asyncio.to_thread(_frame_sums, view(r.addr, w.size), w.frame_size)
            # Landed by this process, summed from the same pages: nothing to read back.
            done = await store.commit_writes(tenant, plan.id, sums, read_back=False) if sums else {}
            committed = True
        finally:
            for _, region in landings:
                self.memory.drop_landing(region)
            if not committed and plan.writes:
                with contextlib.suppress(KVStoreError):
                    await store.abandon_writes(tenant, plan.id)
        results: list[dict[str, Any]] = []
        total = 0
        for key, (_, _, n, _) in zip(keys, blocks, strict=True):
            res: Stored | KVStoreError = empty
            if n > 0:
                res = done[key] if key in done else plan.declined.get(key) or plan.existing[key]
            if isinstance(res, KVStoreError):
                results.append(item_answer(key, res))
                continue
            results.append({"key": key, "status": 201 if res.created else 200, "size": n, "created": res.created})
            total += n if res.created else 0
        self.counts["writes"] += 1
        self.counts["write_bytes"] += total
        store.metrics.inc("kvstore_nixl_bytes_total", total, op="write", source="segment")
        return results

    async def _transfer(self, op: str, peer: str, spans: list[tuple[int, int, int, int]]) -> None:
        """One transfer of (local addr, remote addr, len, remote dev) spans;
        raises ``TransferFailed`` on an error or past the request timeout."""
        agent = self.agent
        deadline = time.monotonic() + self._config.request_timeout_s
        try:
            local = agent.get_xfer_descs([(a, n, 0) for a, _, n, _ in spans], "DRAM")
            remote = agent.get_xfer_descs([(r, n, d) for _, r, n, d in spans], "DRAM")
            handle = agent.initialize_xfer(op, local, remote, peer)
        except Exception as e:  # noqa: BLE001 - NIXL's errors: bad descriptors, a peer gone
            raise TransferFailed(f"the transfer from agent {peer!r} could not start: {e}") from None
        try:
            state = agent.transfer(handle)
            spin_until = time.monotonic() + POLL_S[0]
            delay = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferFailed(f"the transfer from agent {peer!r} did not finish in time")
                # Yield (other tasks run) while the transfer is young; then sleep, at most POLL_S[1].
                await asyncio.sleep(delay)
                if time.monotonic() > spin_until:
                    delay = min(max(delay * 2, 0.0005), POLL_S[1])
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailed(f"the transfer from agent {peer!r} failed")
        except TransferFailed:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the peer disconnected mid-transfer
            raise TransferFailed(f"the transfer from agent {peer!r} failed: {e}") from None
        finally:
            try:
                handle.release()
            except Exception as e:  # noqa: BLE001 - one that cannot be cancelled is logged, its memory kept
                log.warning("NIXL transfer handle not released: %s", e)

    # -- status -----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "agent": self.name,
            "backend": self._config.nixl_backend,
            "ucx_devices": self.devices,
            "peers": len(self._peers),
            "leases": len(self._leases),
            "memory": self.memory.stats(),
            **self.counts,
        }

    def close(self) -> None:
        for lease in self._leases.values():
            self._end(lease)
        self._leases.clear()
        self.memory.close()
        for name in list(self._peers):
            self._forget(name)
        self.agent = None  # destroyed now, not at the interpreter's exit (a crash there)

"""kvstore as an L2 adapter of LMCache's multiprocess (MP) mode (LMCache 0.5.x).

An ``lmcache server`` keeps L1 in host memory and drives L2 stores through
``L2AdapterInterface`` adapters; this one is loaded with LMCache's ``plugin``
adapter type::

    lmcache server --l1-size-gb 20 --eviction-policy LRU \\
      --l2-adapter '{"type": "plugin",
                     "module_path": "kvstore_client.adapters.lmcache_mp",
                     "class_name": "KVStoreL2Adapter",
                     "adapter_params": {"endpoints": "http://10.0.0.5:8420",
                                        "token_file": "/etc/kvstore/tenant.token"}}'

``adapter_params`` (LMCache builds :class:`KVStoreL2AdapterConfig` from them,
found by its name): ``endpoints`` (required: URLs, or ``unix:PATH`` for a
daemon on this host, whose loads then read the segment files through read
plans), ``token`` / ``token_file`` (else ``$KVSTORE_TOKEN``), ``timeout``
(seconds per call, default 10: a batch is one call), ``retries``,
``replicas``, ``ca_file``, ``transport`` (``http`` or ``nixl``),
``nixl_devices``, ``lock_lease_s`` (default 60: how long a lookup's lock
lasts if LMCache never unlocks), ``max_capacity_bytes`` (default 0: the
daemon's tenant quota bounds the space and evicts; set it to let LMCache's
own L2 eviction run through :meth:`KVStoreL2Adapter.delete` as well).

**Keys.** An ``ObjectKey`` (model, KV rank, object group, chunk hash, cache
salt) maps reversibly onto one kvstore key::

    lmp@<model>@<kv_rank hex>@<object group hex>@<chunk hash hex>[@<cache salt>]

model and salt with every character outside ``[A-Za-z0-9._:=+-]`` written
``~XX`` (its UTF-8 bytes in hex), so ``@`` only separates fields. A key that
would pass the daemon's 256 characters is ``lmp~`` + BLAKE2b-128 of the
fields instead (stored and loaded alike; not reversible, so not listed).

**The cache salt is part of the key, not a tenant.** Salts are created on the
fly by requests (a user, a deployment), unbounded in number; a kvstore tenant
is provisioned by an operator with the admin token and owns its own data
key, segment files and quota, so one per salt would put admin credentials in
the inference server and scatter small tenants over the disk. In the key,
two salts never share a block, the salt is never lost (every stored key
names it, and :meth:`KVStoreL2Adapter.list_l2_keys` gives it back), and
LMCache's per-salt quotas work from this adapter's per-salt byte counts
(:meth:`get_usage`) and :meth:`delete`. The tenant (the token) isolates the
LMCache deployment from the daemon's other users; a deployment that wants a
salt sealed under its own key runs an adapter per tenant.

**Values** are the memory object's bytes as they are (``byte_array``, no
header, as LMCache's ``fs`` adapter stores them): stores send the L1 buffers
themselves, loads read into them (``get_many_into``: the HTTP body, a read
plan's ``preadv`` or a NIXL READ lands in LMCache's own memory). A load is
successful only if it fills the object exactly.

**Locks** are kvstore leases: a lookup-and-lock task is one ``/v1/lookup``
call with ``lease_s`` per daemon, which pins the present blocks (never
evicted by the tenant's quota, expired by its TTL, or compacted) until every
key it locked is unlocked, or ``lock_lease_s``. Unlocks release leases in the
background, retried until done or expired. ``delete`` (LMCache's eviction)
skips keys this adapter holds locked.

**Listing** (``list_l2_keys``, LMCache's ``GET /cache/objects?tier=l2``):
``GET /v1/keys`` under ``lmp@<model>@``, each daemon in turn.

**Load planning** (``prefill_tokens_per_s`` set, ``load_margin``,
``chunk_tokens``): a lookup reports the leading run of found chunks only
where loading it beats recomputing it (kvstore_client/adapters/planner.py;
the chunks' bytes from the lookup's layouts), else none, and releases the
locks of what it does not report; a load runs under the recompute time of
its chunks, through ``get_prefix``.

**Fail-open:** nothing raises into LMCache's controller threads; a failed
call fails its task (stores) or leaves bits unset (lookups, loads).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from kvstore_client.adapters._common import (
    CLIENT_SETTINGS,
    PLAN_SETTINGS,
    LoopThread,
    Settings,
    escape,
    load_planner,
    unescape,
)
from kvstore_client.adapters.planner import ReadLimit, told_recompute
from kvstore_client.client import AsyncClient
from kvstore_client.lookups import Locks

log = logging.getLogger("kvstore_client.adapters.lmcache_mp")

SETTINGS = (*CLIENT_SETTINGS, "lock_lease_s", "max_capacity_bytes", "chunk_tokens", *PLAN_SETTINGS)
PREFIX = "lmp"
SEP = "@"
MAX_KEY = 256
_UNSAFE = re.compile(r"[^A-Za-z0-9._:=+-]")
DELETE_CONCURRENCY = 64
RELEASE_RETRY_S = (0.05, 2.0)  # backoff of a lease release that failed: first, most
CLOSE_WAIT_S = 5.0
PRUNE_S = 30.0  # how often locks past their lease are forgotten


# -- keys --------------------------------------------------------------------------------


def kvstore_key(key: ObjectKey) -> str:
    """The kvstore key of an LMCache ``ObjectKey`` (see the module docstring)."""
    fields = [
        PREFIX,
        escape(key.model_name, _UNSAFE),
        f"{key.kv_rank:x}",
        f"{key.object_group_id:x}",
        key.chunk_hash.hex(),
    ]
    if key.cache_salt:
        fields.append(escape(key.cache_salt, _UNSAFE))
    out = SEP.join(fields)
    if len(out) <= MAX_KEY:
        return out
    return PREFIX + "~" + hashlib.blake2b(out.encode("ascii"), digest_size=16).hexdigest()


def object_key(kv_key: str) -> ObjectKey | None:
    """The ``ObjectKey`` a kvstore key was mapped from; None for any other
    key (another client's, a hashed long one, a malformed one)."""
    parts = kv_key.split(SEP)
    if parts[0] != PREFIX or len(parts) not in (5, 6):
        return None
    try:
        return ObjectKey(
            chunk_hash=bytes.fromhex(parts[4]),
            model_name=unescape(parts[1]),
            kv_rank=int(parts[2], 16),
            object_group_id=int(parts[3], 16),
            cache_salt=unescape(parts[5]) if len(parts) == 6 else "",
        )
    except (ValueError, IndexError):
        return None


def _layout_bytes(layouts: Any, group: int) -> int:
    """One object's bytes in ``group`` from the lookup's layouts
    (``{object_group_id: MemoryLayoutDesc}``); 0 if they do not say."""
    try:
        desc = layouts[group]
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(desc.shapes, desc.dtypes, strict=True))
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return 0


# -- configuration -----------------------------------------------------------------------


class KVStoreL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """The adapter's ``adapter_params``, checked (unknown names and bad values
    are refused, naming the setting)."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = dict(params)
        self.settings = Settings(self.params, "kvstore LMCache L2 adapter (adapter_params)", SETTINGS)
        self.settings.endpoints()  # required: checked now, not at the first store
        self.lock_lease_s = self.settings.get_float("lock_lease_s", 60.0)
        if self.lock_lease_s > 600:
            raise ValueError(
                f"kvstore LMCache L2 adapter (adapter_params): setting lock_lease_s={self.lock_lease_s!r} "
                "is invalid: expected at most 600 seconds (the daemon's longest lease)"
            )
        self.max_capacity_bytes = self.settings.get_int("max_capacity_bytes", 0)
        self.timeout = self.settings.get_float("timeout", 10.0)
        self.chunk_tokens = self.settings.get_int("chunk_tokens", 256, minimum=1)
        self.load_planner = load_planner(self.settings)  # checked now; each adapter makes its own

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVStoreL2AdapterConfig:
        return cls({k: v for k, v in d.items() if k != "type"})

    @classmethod
    def help(cls) -> str:
        return (
            "kvstore L2 adapter (plugin) adapter_params:\n"
            "- endpoints (str or list): kvstore URLs or unix:PATH (required)\n"
            "- token / token_file (str): the tenant's token (else $KVSTORE_TOKEN)\n"
            "- timeout (s, default 10), retries, replicas, ca_file, transport (http|nixl), nixl_devices\n"
            "- lock_lease_s (s, default 60, at most 600): a lookup's lock lasts at most this long\n"
            "- max_capacity_bytes (int, default 0): >0 lets LMCache's L2 eviction delete here too\n"
            "- prefill_tokens_per_s (tokens/s): plan lookups: report a hit prefix only where loading beats\n"
            "  recomputing it; load_margin (default 1.1); chunk_tokens (LMCache's chunk_size, default 256)"
        )


# -- the adapter ------------------------------------------------------------------------


@dataclass(eq=False)
class _Held:
    """One lookup's leases and how many of its locked keys are not unlocked yet."""

    locks: Locks
    remaining: int
    expires: float  # time.monotonic()


class KVStoreL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """LMCache ``L2AdapterInterface`` on a kvstore daemon. LMCache's store and
    prefetch controller threads call in; the work runs on this adapter's own
    event loop thread, and completions are signalled on the three event fds."""

    def __init__(self, config: KVStoreL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None) -> None:
        if not isinstance(config, KVStoreL2AdapterConfig):
            config = KVStoreL2AdapterConfig(config)
        super().__init__(max_capacity_bytes=config.max_capacity_bytes)
        self._config = config
        self._l1_memory_desc = l1_memory_desc  # unused: buffers are registered per read (NIXL) or not at all
        self._loop = LoopThread("kvstore-lmcache-l2")
        self.client: AsyncClient = config.settings.client(timeout=config.timeout)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id = 0
        self._stores: dict[int, L2StoreResult] = {}
        self._lookups: dict[int, Bitmap] = {}
        self._loads: dict[int, Bitmap] = {}
        self._held: dict[ObjectKey, collections.deque[_Held]] = {}
        # Keys this adapter stored, with their sizes, for the usage counts a
        # delete must take back (about 300 bytes a chunk, as LMCache's own
        # per-key eviction state).
        self._sizes: dict[ObjectKey, int] = {}
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._next_prune = time.monotonic() + PRUNE_S
        self._closed = False
        self.failures = collections.Counter[str]()
        self.planner = load_planner(config.settings)
        self._read_limit = ReadLimit()
        self.planned_recompute = 0  # chunks found but not reported: recomputing them is sooner
        log.info(
            "kvstore L2 adapter on %s (lock_lease_s=%s, max_capacity_bytes=%s)",
            ", ".join(self.client.endpoints),
            config.lock_lease_s,
            config.max_capacity_bytes,
        )

    # -- event fds --------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- tasks --------------------------------------------------------------------------

    def _task_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def _spawn(self, coro: Any) -> bool:
        """Run ``coro`` on the loop; False (and the coroutine closed) once closed."""
        try:
            fut = self._loop.submit(coro)
        except RuntimeError:
            return False
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return True

    def _forget(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        task_id = self._task_id()
        if not self._spawn(self._store(task_id, list(keys), list(objects))):
            self._finish_store(task_id, L2StoreResult(False, 0))
        return task_id

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: Any = None) -> int:
        task_id = self._task_id()
        if not self._spawn(self._lookup(task_id, list(keys), group_layout_descs)):
            self._finish(self._lookups, self._lookup_efd, task_id, Bitmap(len(keys)))
        return task_id

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Unlock one lock of each key (a key locked by two lookups stays
        locked until unlocked twice). A lookup's lease is released once all
        its keys are unlocked, in the background and retried until done (or
        the lease expired on its own); unknown keys are ignored."""
        now = time.monotonic()
        done: list[_Held] = []
        with self._lock:
            for key in keys:
                q = self._held.get(key)
                if not q:
                    continue
                held = q.popleft()
                if not q:
                    del self._held[key]
                held.remaining -= 1
                if held.remaining == 0 and held.expires > now:
                    done.append(held)
        for held in done:
            self._spawn(self._release(held))

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        task_id = self._task_id()
        if not self._spawn(self._load(task_id, list(keys), list(objects))):
            self._finish(self._loads, self._load_efd, task_id, Bitmap(len(keys)))
        return task_id

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    def _finish(self, results: dict[int, Bitmap], efd: Any, task_id: int, bitmap: Bitmap) -> None:
        with self._lock:
            results[task_id] = bitmap
        efd.notify()

    def _finish_store(self, task_id: int, result: L2StoreResult) -> None:
        with self._lock:
            self._stores[task_id] = result
        self._store_efd.notify()

    # -- the work, on the loop --------------------------------------------------------

    async def _store(self, task_id: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        result = L2StoreResult(False, 0)
        try:
            views = [memoryview(o.byte_array) for o in objects]
            statuses = await self.client.put_many_detail(zip([kvstore_key(k) for k in keys], views, strict=True))
            # 202: its tenant's admission declined it (admit_after): not stored, not a failure.
            nbytes = sum(v.nbytes for v, st in zip(views, statuses, strict=True) if st in (200, 201))
            result = L2StoreResult(None not in statuses, nbytes)
            if None in statuses:
                self.failures["store"] += 1
            # Counted once, by the server that stored it (201; 200: it was there already).
            new = [(k, v.nbytes) for k, v, st in zip(keys, views, statuses, strict=True) if st == 201]
            with self._lock:
                self._sizes.update(new)
            if new:
                self._notify_keys_stored([k for k, _ in new], [n for _, n in new])
        except Exception:
            self.failures["store"] += 1
            log.exception("kvstore L2 store task %d failed", task_id)
        finally:
            self._finish_store(task_id, result)

    async def _lookup(self, task_id: int, keys: list[ObjectKey], layouts: Any = None) -> None:
        bitmap = Bitmap(len(keys))
        try:
            present, locks = await self.client.lookup_and_lock(
                [kvstore_key(k) for k in keys], self._config.lock_lease_s
            )
            hits = [i for i, p in enumerate(present) if p]
            if self.planner is not None and hits:
                hits = await self._plan(keys, hits, layouts)
            now = time.monotonic()
            held = None
            with self._lock:
                if now >= self._next_prune:
                    self._prune(now)
                if locks:
                    held = _Held(locks, len(hits), now + self._config.lock_lease_s)
                    for i in hits:
                        self._held.setdefault(keys[i], collections.deque()).append(held)
            if held is not None and not hits:  # nothing reported: nothing to keep locked
                self._spawn(self._release(held))
            for i in hits:
                bitmap.set(i)
        except Exception:
            self.failures["lookup"] += 1
            log.exception("kvstore L2 lookup task %d failed", task_id)
        finally:
            self._finish(self._lookups, self._lookup_efd, task_id, bitmap)

    async def _plan(self, keys: list[ObjectKey], hits: list[int], layouts: Any) -> list[int]:
        """The hits to report: LMCache loads the leading run of them, and
        only that run is weighed (kvstore_client/adapters/planner.py): all of
        it where loading beats recomputing its ``chunk_tokens`` per chunk,
        else none. The chunk size comes from the lookup's layouts; without
        them nothing is planned."""
        assert self.planner is not None
        run = 0
        while run < len(hits) and hits[run] == run:
            run += 1
        sizes = [_layout_bytes(layouts, k.object_group_id) for k in keys[:run]]
        if run == 0 or not all(sizes):
            return hits[:run]
        plan = self.planner.plan(
            run,
            self._config.chunk_tokens,
            sum(sizes) // run,
            self.client.bandwidth(),
            await self._read_limit.aget(self.client.read_limit),
        )
        self.planned_recompute += told_recompute(log, plan, run, "L2 lookup", "found chunks")
        return hits[: plan.blocks]

    def _prune(self, now: float) -> None:
        """Forget locks past their lease (LMCache never unlocked them: a
        request cut short); under ``self._lock``."""
        self._next_prune = now + PRUNE_S
        for key in [k for k, q in self._held.items() if all(h.expires <= now for h in q)]:
            del self._held[key]

    async def _load(self, task_id: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            views = [memoryview(o.byte_array) for o in objects]
            names = [kvstore_key(k) for k in keys]
            got: list[int | None]
            deadline = self._deadline(len(keys))
            if deadline is None:
                got = await self.client.get_many_into(names, views)
            else:  # a planned load stops at its deadline: LMCache recomputes what did not arrive
                arrived = await self.client.get_prefix(names, views, deadline)
                got = [v.nbytes for v in views[:arrived]] + [None] * (len(keys) - arrived)
            loaded = []
            for i, (n, v) in enumerate(zip(got, views, strict=True)):
                if n is not None and n == v.nbytes:
                    bitmap.set(i)
                    loaded.append(keys[i])
                elif n is not None:
                    log.warning("kvstore L2 load of %s: %d bytes stored, the object holds %d", keys[i], n, v.nbytes)
            if loaded:
                self._notify_keys_accessed(loaded)
        except Exception:
            self.failures["load"] += 1
            log.exception("kvstore L2 load task %d failed", task_id)
        finally:
            self._finish(self._loads, self._load_efd, task_id, bitmap)

    def _deadline(self, chunks: int) -> float | None:
        """A planned load's deadline: recomputing its chunks (None: no planning)."""
        if self.planner is None or self.planner.prefill_tokens_per_s <= 0:
            return None
        return chunks * self._config.chunk_tokens / self.planner.prefill_tokens_per_s

    async def _release(self, held: _Held) -> None:
        """Release ``held``'s leases until done or expired (an unlock must
        always succeed eventually: LMCache never retries one)."""
        locks = held.locks
        delay = RELEASE_RETRY_S[0]
        while locks and time.monotonic() < held.expires:
            locks = await self.client.release_locks(locks)
            if locks:
                self.failures["unlock_retry"] += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, RELEASE_RETRY_S[1])

    # -- optional interface ---------------------------------------------------------------

    def _locked(self, key: ObjectKey, now: float) -> bool:
        q = self._held.get(key)
        return bool(q) and any(h.expires > now for h in q or ())

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete blocks (LMCache's L2 eviction, or an operator's request);
        keys this adapter holds locked are skipped. Waits at most the
        client's timeout; failures are logged, never raised."""
        now = time.monotonic()
        with self._lock:
            todo = [k for k in keys if not self._locked(k, now)]
        if not todo:
            return

        async def run() -> list[bool]:
            sem = asyncio.Semaphore(DELETE_CONCURRENCY)

            async def one(k: ObjectKey) -> bool:
                async with sem:
                    return await self.client.delete(kvstore_key(k))

            return await asyncio.gather(*(one(k) for k in todo))

        try:
            gone = self._loop.run(run(), timeout=self._config.timeout + 1)
        except Exception as e:  # noqa: BLE001 - fail-open: LMCache's eviction thread must not see it
            self.failures["delete"] += 1
            log.warning("kvstore L2 delete of %d keys failed: %r", len(todo), e)
            return
        with self._lock:
            deleted = [(k, self._sizes.pop(k)) for k, ok in zip(todo, gone, strict=True) if ok and k in self._sizes]
        if deleted:
            self._notify_keys_deleted([k for k, _ in deleted], [n for _, n in deleted])

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None) -> Any:
        """A page of the chunks the daemons hold (all of them, or of one
        model), with their salts. The cursor is ``<endpoint index>:<last
        key>``; endpoints are listed one after the other. Hashed (long) keys
        are not listed. Raises ValueError on a bad page size or cursor, and
        RuntimeError when a daemon cannot answer."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        ep, after = 0, None
        if cursor:
            head, sep, tail = cursor.partition(":")
            if not sep or not head.isdigit() or int(head) >= len(self.client.endpoints):
                raise ValueError(f"malformed cursor {cursor!r}")
            ep, after = int(head), tail or None
        prefix = SEP.join([PREFIX, escape(model_name, _UNSAFE), ""]) if model_name else PREFIX + SEP
        url = self.client.endpoints[ep]
        try:
            keys, nxt = self._loop.run(
                self.client.list_keys(prefix, after, min(page_size, 10_000), url), timeout=self._config.timeout + 1
            )
        except Exception as e:
            raise RuntimeError(f"kvstore listing at {url} failed: {e}") from e
        entries = []
        for k, size in keys:
            ok = object_key(k)
            if ok is not None:
                entries.append(KeyEntry(key=ok.to_encoded_object_key(), size_bytes=size))
        token = f"{ep}:{nxt}" if nxt is not None else f"{ep + 1}:" if ep + 1 < len(self.client.endpoints) else None
        return KeyListPage(entries=tuple(entries), next_page_token=token)

    def report_status(self) -> dict[str, Any]:
        breakers = {ep: self.client.breaker_state(ep) for ep in self.client.endpoints}
        with self._lock:
            locked = len(self._held)
            pending = len(self._pending)
        return {
            "is_healthy": not self._closed and all(state != "open" for state in breakers.values()),
            "type": "KVStoreL2Adapter",
            "endpoints": breakers,
            "locked_keys": locked,
            "tasks_in_flight": pending,
            "failures": dict(self.failures),
            "client": dict(self.client.stats),
        }

    # -- close ----------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the tasks in flight (at most a few seconds), release the
        locks still held, close the client, the loop and the event fds."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._pending)
            held = {id(h): h for q in self._held.values() for h in q}
            self._held.clear()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for fut in pending:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - its own handler logged it; a timeout: cut it short
                fut.cancel()
        now = time.monotonic()
        leases = Locks(tuple(lease for h in held.values() if h.expires > now for lease in h.locks.leases))
        if leases:
            try:
                self._loop.run(self.client.release_locks(leases), timeout=CLOSE_WAIT_S)
            except Exception as e:  # noqa: BLE001 - they expire on their own
                log.warning("kvstore L2 adapter: releasing locks at close failed: %r", e)
        self._loop.close([self.client])
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
        log.info("kvstore L2 adapter closed")

"""kvstore as an SGLang HiCache storage backend (SGLang 0.5.x, the L3 tier).

Load it with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore_client.adapters.sglang", "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1, "endpoints": "http://127.0.0.1:8420", "token_file": "/etc/kvstore/tenant.token"}'

SGLang builds the class as ``KVStoreHiCacheStorage(storage_config, kwargs)``
through its ``StorageBackendFactory`` and then registers its host memory pool.
Settings in the extra config: ``endpoints`` (required), ``token`` /
``token_file`` (else ``$KVSTORE_TOKEN``), ``timeout`` (s per call, default 2),
``retries``, ``replicas``, ``ca_file``; SGLang's own ``backend_name``,
``module_path``, ``class_name``, ``interface_v1`` (1: SGLang uses the
``batch_get_v1``/``batch_set_v1`` paths, which move pages straight between
kvstore and the host pool's page buffers), ``tp_lcm_size``,
``enable_metadata_cache`` and ``metadata_ttl`` are accepted; anything else is
refused at start-up.

Load planning (``prefill_tokens_per_s``: the engine's prefill throughput;
``load_margin``, default 1.1): ``batch_exists`` answers the stored pages only
when loading them is expected to take at most ``1 / load_margin`` of
recomputing them, from the bandwidth the client measured from its loads and
the tenant's QoS read limit (kvstore_client/adapters/planner.py); else 0,
and SGLang computes those pages instead of prefetching them. The loads
themselves run under SGLang's own prefetch policy (``prefetch_stop_policy``).

Keys: SGLang's page keys are content hashes chained over the token prefix.
kvstore stores page ``h`` under ``sgl.<fp>.<h>``, ``fp`` being the client
library's model fingerprint of the model name, the host pool's dtype and
layout (layout, page size, heads, head size, layers), the TP rank and size
(rank 0 of 1 for MLA models, whose ranks hold the same KV) and the PP, attention
CP, DP and DCP ranks. A key that does not fit the kvstore key grammar is
replaced by its BLAKE2b-128 digest.

Values: the page's bytes, in the host pool's page layout: for the v1 paths,
the buffers ``get_page_buffer_meta`` names for the page, concatenated in that
order (e.g. K then V of each layer for ``layer_first``); for ``get``/``set``,
the flat page tensor SGLang passes. A value whose size does not match the
destination is a miss.

Fail-open: every call returns its miss value on any failure (``get`` None,
``batch_get`` a list of None, ``exists`` False, ``batch_exists`` 0, the v1
calls and ``batch_set`` lists of False / False) within the timeout: never
None where SGLang expects a list or a bool (that would stop its prefetch
thread for good), never an exception. ``clear`` is a no-op: kvstore keeps
blocks across engine restarts on purpose.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvstore_client.adapters._common import CLIENT_SETTINGS, PLAN_SETTINGS, LoopThread, Settings, load_planner
from kvstore_client.adapters.planner import ReadLimit, told_recompute
from kvstore_client.client import AsyncClient
from kvstore_client.keys import check_key, model_fingerprint

log = logging.getLogger("kvstore_client.adapters.sglang")

T = TypeVar("T")
SGLANG_SETTINGS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "tp_lcm_size",
    "enable_metadata_cache",
    "metadata_ttl",
)
SETTINGS = (*CLIENT_SETTINGS, *SGLANG_SETTINGS, *PLAN_SETTINGS)


def _bytes_view(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A CPU tensor's memory as a flat uint8 array (no copy for contiguous tensors)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    view: np.ndarray[Any, Any] = flat.view(torch.uint8).cpu().numpy()
    return view


def _host_view(ptr: int, size: int) -> np.ndarray[Any, Any]:
    """``size`` bytes of host memory at ``ptr`` (a host pool page buffer), writable."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))


class KVStoreHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang ``HiCacheStorage`` on kvstore; see the module docstring."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.settings = Settings(extra, "kvstore SGLang backend (hicache storage extra config)", SETTINGS)
        self.timeout = self.settings.get_float("timeout", 2.0)
        self._loop = LoopThread("kvstore-sglang")
        self.client: AsyncClient = self.settings.client()
        self.mem_pool_host: Any = None
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.fingerprint = self._fingerprint()
        self.planner = load_planner(self.settings)
        self._read_limit = ReadLimit(lambda: self._call("read_limit", None, self.client.read_limit))
        self.planned_recompute_pages = 0

    # -- keys ------------------------------------------------------------------------

    def _fingerprint(self) -> str:
        c, pool = self.config, self.mem_pool_host
        mla = bool(getattr(c, "is_mla_model", False))
        tp_rank, tp_size = (0, 1) if mla else (int(c.tp_rank), int(c.tp_size))
        if pool is None:
            dtype, layout = "unregistered", "sglang-hicache;no-host-pool"
        else:
            dtype = str(getattr(pool, "dtype", "")).removeprefix("torch.")
            layout = (
                f"sglang-hicache;{type(pool).__name__};layout={getattr(pool, 'layout', '')};"
                f"page={getattr(pool, 'page_size', '')};heads={getattr(pool, 'head_num', '')};"
                f"head={getattr(pool, 'head_dim', '')};layers={getattr(pool, 'layer_num', '')}"
            )
        extra = ";".join(
            f"{name}={getattr(c, name, '')}"
            for name in ("pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size", "dp_rank", "dcp_rank", "dcp_size")
        )
        return model_fingerprint(str(c.model_name or ""), dtype, layout, tp_rank, tp_size, extra)

    def key(self, page_key: str) -> str:
        """The kvstore key of an SGLang page key."""
        k = f"sgl.{self.fingerprint}.{page_key}"
        try:
            check_key(k)
        except ValueError:
            return f"sgl.{self.fingerprint}~{hashlib.blake2b(page_key.encode(), digest_size=16).hexdigest()}"
        return k

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.fingerprint = self._fingerprint()

    # -- plumbing --------------------------------------------------------------------

    def _call(self, op: str, default: T, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run a coroutine on the client's loop; ``default`` on any failure or timeout."""
        try:
            return self._loop.run(make(), timeout=self.timeout * 2 + 1.0)
        except Exception:  # fail-open: SGLang gets a miss, never an exception
            log.exception("kvstore %s failed; answered as a miss", op)
            return default

    # -- generic (tensor) paths ------------------------------------------------------

    async def _get_into(self, key: str, target: Any) -> Any:
        if isinstance(target, torch.Tensor):
            buf = _bytes_view(target)
            n = await self.client.get_into(self.key(key), buf)
            return target if n == buf.nbytes else None
        blob = await self.client.get(self.key(key))
        return None if blob is None else torch.frombuffer(bytearray(blob), dtype=torch.uint8)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page into ``target_location`` (a tensor of the page's size), or a new
        uint8 tensor without one; None if absent or on failure."""
        result: torch.Tensor | None = self._call("get", None, lambda: self._get_into(key, target_location))
        return result

    async def _batch_get(self, keys: list[str], targets: list[Any]) -> list[Any]:
        import asyncio

        if targets and all(isinstance(t, torch.Tensor) for t in targets):
            # Into the pages given: one get_many_into (over NIXL, one control call and one transfer).
            bufs = [_bytes_view(t) for t in targets]
            got = await self.client.get_many_into([self.key(k) for k in keys], bufs)
            return [t if n == b.nbytes else None for t, b, n in zip(targets, bufs, got, strict=True)]
        return list(await asyncio.gather(*(self._get_into(k, t) for k, t in zip(keys, targets, strict=True))))

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        keys = list(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            log.warning("kvstore batch_get: %d keys, %d targets; answered as misses", len(keys), len(targets))
            return [None] * len(keys)
        misses: list[Any] = [None] * len(keys)
        return self._call("batch_get", misses, lambda: self._batch_get(keys, targets))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        if not self.writer:
            return True  # MLA: another rank stores the same bytes
        data = _bytes_view(value)
        return bool(self._call("set", False, lambda: self.client.put(self.key(key), data)))

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        keys = list(keys)
        vals = list(values) if values is not None else []
        if len(vals) != len(keys) or not all(isinstance(v, torch.Tensor) for v in vals):
            return False
        if not self.writer:
            return True
        items = [(self.key(k), _bytes_view(v)) for k, v in zip(keys, vals, strict=True)]
        ok = self._call("batch_set", [False] * len(items), lambda: self.client.put_many(items))
        return bool(items) and all(ok)

    def exists(self, key: str) -> bool:
        return bool(self._call("exists", False, lambda: self.client.exists(self.key(key))))

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many keys from the start are stored (one lookup call), and
        worth loading: with ``prefill_tokens_per_s`` set, 0 when loading them
        is expected to be slower than recomputing them (SGLang then computes
        those pages instead of prefetching them)."""
        ks = [self.key(k) for k in keys]
        n = int(self._call("batch_exists", 0, lambda: self.client.lookup(ks)))
        if self.planner is None or n == 0 or self.mem_pool_host is None:
            return n
        try:
            page_bytes = sum(self.mem_pool_host.get_page_buffer_meta(torch.arange(0, self.mem_pool_host.page_size))[1])
            tokens = int(self.mem_pool_host.page_size)
        except Exception:  # a pool that cannot say: no planning
            log.exception("kvstore batch_exists: the host pool's page size is unknown; not planning")
            return n
        plan = self.planner.plan(n, tokens, page_bytes, self.client.bandwidth(), self._read_limit.get())
        self.planned_recompute_pages += told_recompute(log, plan, n, "batch_exists", "stored pages")
        return plan.blocks

    # -- v1 paths: pages straight between kvstore and the host pool ------------------

    def _pages(self, n_keys: int, host_indices: Any) -> list[list[np.ndarray[Any, Any]]]:
        """Per page, the host pool's buffers of that page (``get_page_buffer_meta``)."""
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError("no host memory pool registered")
        if len(host_indices) != n_keys * int(pool.page_size):
            raise ValueError(f"{len(host_indices)} host indices for {n_keys} pages of {pool.page_size} tokens")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if n_keys == 0 or len(ptrs) % n_keys or len(ptrs) != len(sizes):
            raise ValueError(f"{len(ptrs)} page buffers for {n_keys} pages")
        per = len(ptrs) // n_keys
        return [[_host_view(ptrs[i * per + j], sizes[i * per + j]) for j in range(per)] for i in range(n_keys)]

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool at ``host_indices``; per key, whether it was loaded."""
        keys = list(keys)
        misses = [False] * len(keys)
        try:
            pages = self._pages(len(keys), host_indices)
        except Exception:
            log.exception("kvstore batch_get_v1: cannot address the host pages; answered as misses")
            return misses
        no_blobs: list[bytes | None] = [None] * len(keys)
        ks = [self.key(k) for k in keys]
        blobs = self._call("batch_get_v1", no_blobs, lambda: self.client.get_many(ks))
        out = []
        for blob, bufs in zip(blobs, pages, strict=True):
            if blob is None or len(blob) != sum(b.nbytes for b in bufs):
                out.append(False)
                continue
            src, at = np.frombuffer(blob, dtype=np.uint8), 0
            for b in bufs:
                np.copyto(b, src[at : at + b.nbytes])
                at += b.nbytes
            out.append(True)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Write the host pool's pages at ``host_indices``; per key, whether it is stored."""
        keys = list(keys)
        if not self.writer:
            return [True] * len(keys)
        try:
            pages = self._pages(len(keys), host_indices)
        except Exception:
            log.exception("kvstore batch_set_v1: cannot address the host pages; nothing stored")
            return [False] * len(keys)
        items = [(self.key(k), b"".join(b.data for b in bufs)) for k, bufs in zip(keys, pages, strict=True)]
        return list(self._call("batch_set_v1", [False] * len(items), lambda: self.client.put_many(items)))

    # -- the rest --------------------------------------------------------------------

    def clear(self) -> None:
        log.info("kvstore: clear() is a no-op (blocks outlive engine restarts on purpose)")

    def close(self) -> None:
        self._loop.close([self.client])

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.client.stats)

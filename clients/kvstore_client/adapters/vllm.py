"""A vLLM v1 KV connector that keeps prompt KV blocks in kvstore.

Load it with (see docs/engines.md for a whole command line)::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore_client.adapters.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"endpoints": "http://127.0.0.1:8420",
                                                         "token_file": "/etc/kvstore/tenant.token",
                                                         "model": "meta-llama/Llama-3.1-8B@main"}}'

What it does:

* **Keys.** One kvstore block per engine block (``block_size`` tokens, all
  attention layers) and per TP/PP rank. The key is the client library's
  chained content key (:func:`kvstore_client.keys.block_keys`) over the prompt
  token ids, under a fingerprint (:func:`~kvstore_client.keys.model_fingerprint`)
  of the model (``model`` setting, else vLLM's model name and revision), the KV
  dtype, the layout (platform, block size, KV heads, head sizes, layers), the
  TP rank and size, the PP rank and size, and per request the LoRA adapter, the
  cache salt and the multimodal inputs' hashes. Only full blocks of the prompt
  are stored.
* **Scheduler side.** ``get_num_new_matched_tokens`` asks kvstore once
  (``lookup`` of the request's keys for every rank, one call) how many leading
  blocks every rank can supply beyond the engine's own prefix-cache hit, and
  never the whole prompt (the last token is always computed).
  ``build_connector_meta`` tells the workers which blocks to load into which
  engine blocks, and which newly computed full blocks to save (those kvstore
  did not already report present).
* **Worker side.** The layout comes from ``register_kv_caches``: for each
  layer, the dimension of size ``num_blocks`` is the block dimension, whatever
  the backend (CPU: ``(blocks, kv_heads, block_size, 2*head_size)``; CUDA flash
  attention: ``(2, blocks, block_size, kv_heads, head_size)``). A stored block
  is a 16-byte header (magic and a hash of that per-layer layout) followed by
  each layer's slice of the engine block in layer order; a block whose header
  does not match this worker's layout is a load error, never wrong KV.
  Loads run on a background event loop (``load_mode="async"``, the default:
  the request waits in ``WAITING_FOR_REMOTE_KVS`` while other requests run, and
  ``get_finished`` reports it done), before the forward pass
  (``load_mode="sync"``), or beside it (``load_mode="layerwise"``). Saves copy the blocks to host buffers in
  ``wait_for_save`` (a memcpy) and send them in the background, so the engine
  never waits for the network and the engine's blocks are free to reuse at
  once; at most ``max_pending_save_mb`` of saves wait for the network, beyond
  that saves are dropped (and counted).
* **Layerwise loading** (``load_mode="layerwise"``). An engine block is
  stored as ``layer_groups`` (4) kvstore blocks, one per contiguous group of
  layers, each with its header; ``start_load_kv`` starts loading the groups
  in order (each through ``get_prefix``, under the load's deadline) into
  staging buffers and returns; ``wait_for_layer_load(layer)`` waits for that
  layer's group and copies that layer in. The forward pass computes the new
  tokens' first layers while the last ones load. A block some layer did not
  get is a load error after the step (vLLM recomputes it); only the forward
  thread writes into the paged cache. ``layer_groups`` is in the key
  fingerprint, so blocks stored one way are not found the other way.
* **Load planning** (``prefill_tokens_per_s`` set: the engine's prefill
  throughput): a hit prefix is loaded only when loading it is expected to
  take at most ``1 / load_margin`` (1.1) of recomputing it, from the
  bandwidth this process's loads measured (``AsyncClient.bandwidth``) and
  the tenant's QoS read limit (``GET /v1/stats``), whichever is lower
  (kvstore_client/adapters/planner.py); otherwise the engine recomputes it.
  A planned load runs against a deadline, the time recomputing it would
  take: blocks that did not arrive by then are load errors the engine
  recomputes. The prefill throughput starts from the setting and follows
  what the scheduler measures of steps of 256 tokens or more (their tokens
  over the time to the next step). Without ``prefill_tokens_per_s`` every
  hit is loaded.
* **Fail-open.** A kvstore that is down, slow or erroring is a miss: lookups
  time out after ``lookup_timeout`` s, a request's loads after
  ``load_timeout`` s, and every block that did not load is reported through
  ``get_block_ids_with_load_errors`` (with ``kv_load_failure_policy:
  "recompute"`` vLLM then recomputes those tokens; vLLM's default ``"fail"``
  fails the request instead). The client's circuit breaker turns a dead
  daemon into immediate misses. Nothing here raises into the engine after
  start-up; a bad setting stops start-up naming the setting.

Not covered: models with more than one KV cache group (hybrid/sliding-window
groups, Mamba), decode context parallelism, prompt embeddings, KV of generated
tokens (a later turn's prompt contains them and stores them then).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore_client.adapters._common import CLIENT_SETTINGS, PLAN_SETTINGS, LoopThread, Settings, load_planner
from kvstore_client.adapters.planner import LoadPlan, ReadLimit, told_recompute
from kvstore_client.answers import NOT_ADMITTED
from kvstore_client.client import AsyncClient
from kvstore_client.keys import block_keys, model_fingerprint
from kvstore_client.prefix import process_bandwidth

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging configuration (handlers, VLLM_LOGGING_LEVEL) applies.
log = logging.getLogger("vllm.kvstore_connector")

SETTINGS = (
    *CLIENT_SETTINGS,
    "model",
    "lookup_timeout",
    "load_timeout",
    "save_timeout",
    "load_mode",
    "max_pending_save_mb",
    "load_concurrency",
    "layer_groups",
    *PLAN_SETTINGS,
)
HEADER_MAGIC = b"kvsvllm1"  # 8 bytes, then 8 bytes of blake2b(layout description)
HEADER_SIZE = 16
IDLE_WAIT = 0.05  # s: the longest an idle engine step waits for an async load (see get_finished)
PREFILL_MIN_TOKENS = 256  # a step with fewer scheduled tokens says little of prefill throughput
STEP_MAX_S = 10.0  # a step "taking" longer was an idle engine, not computation
LAYERWISE_GROUPS = 4  # layer groups (kvstore blocks per engine block) when load_mode is "layerwise"


# -- metadata: scheduler -> workers (pickled between processes) -------------------


@dataclass
class BlockTransfer:
    """Engine blocks of one request and, per rank label, their kvstore keys."""

    req_id: str
    block_ids: list[int]
    keys: dict[str, list[str]]
    # The engine's identity of each block (saves), for kvstore's residency events.
    metas: list[dict[str, Any] | None] | None = None
    deadline_s: float | None = None  # a planned load: the most it may take (planner.py)


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    async_loads: bool = True


def rank_label(tp_rank: int, pp_rank: int) -> str:
    return f"tp{tp_rank}pp{pp_rank}"


def group_label(rank: str, group: int, groups: int) -> str:
    """The keys' label of a rank's layer group (the rank's own with one group)."""
    return rank if groups == 1 else f"{rank}:g{group}"


@dataclass
class _RequestState:
    """Scheduler-side bookkeeping of one request."""

    tokens: list[int]
    keys: dict[str, list[str]]  # rank label -> keys of the prompt's full blocks
    present: list[bool]  # per full block: kvstore has it for every rank (from the last lookup)
    idents: list[dict[str, Any] | None] = field(default_factory=list)  # per full block: the engine's identity
    block_ids: list[int] = field(default_factory=list)
    load_start: int = 0  # pending load: blocks [load_start, load_end)
    load_end: int = 0
    load_queued: bool = False
    load_deadline_s: float | None = None  # the planned load's deadline
    saved_upto: int = 0  # blocks below this are loaded, saved or were present


@dataclass
class _Layer:
    name: str
    tensor: torch.Tensor
    block_dim: int
    block_shape: tuple[int, ...]
    nbytes: int
    group: int = 0  # the layer group (kvstore block of an engine block) it is stored in
    offset: int = 0  # where its slice starts in its group's kvstore block


@dataclass
class _Group:
    """The layers stored in one kvstore block of an engine block."""

    layers: list[_Layer]
    header: bytes
    nbytes: int  # header and the layers' slices


@dataclass
class _LayerwiseLoad:
    """One request's layerwise load: per layer group, when its blocks have
    arrived (how many leading blocks, in staging buffers) and which of its
    layers have been copied into the paged cache."""

    load: BlockTransfer
    until: float  # monotonic: the load's deadline (or its load_timeout)
    arrived: list[concurrent.futures.Future[int]]
    bufs: list[list[torch.Tensor]]
    task: concurrent.futures.Future[None] | None = None
    copied: set[str] = field(default_factory=set)
    upto: int | None = None  # the fewest blocks any group delivered to the layers that waited


class KVStoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM ``KVConnectorBase_V1`` on kvstore; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = s = Settings(extra, "kvstore vLLM connector (kv_connector_extra_config)", SETTINGS)
        s.endpoints()  # refuse a missing endpoint list at start-up
        self.lookup_timeout = s.get_float("lookup_timeout", 0.5)
        self.load_timeout = s.get_float("load_timeout", 10.0)
        self.save_timeout = s.get_float("save_timeout", 30.0)
        mode = s.choice("load_mode", "async", ("async", "sync", "layerwise"))
        self.load_async = mode == "async"
        self.layerwise = mode == "layerwise"
        self.layer_groups = s.get_int("layer_groups", LAYERWISE_GROUPS if self.layerwise else 1, minimum=1)
        self.max_pending_save_bytes = int(s.get_float("max_pending_save_mb", 1024.0) * (1 << 20))
        self.load_concurrency = s.get_int("load_concurrency", 16, minimum=1)
        self.planner = load_planner(s)
        self._read_limit = ReadLimit(self._ask_read_limit)
        self._last_step: tuple[float, int] | None = None  # (when, tokens scheduled): the last step's
        # Host buffers of finished loads, per layer group, for the next (over NIXL: registered once).
        self._load_buffers: list[dict[int, list[torch.Tensor]]] = []
        tc = self._kv_transfer_config
        self.do_load = bool(getattr(tc, "is_kv_consumer", True))
        self.do_save = bool(getattr(tc, "is_kv_producer", True))

        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        self.block_size = int(cc.block_size)
        self.tp_size = int(pc.tensor_parallel_size)
        self.pp_size = int(pc.pipeline_parallel_size)
        self.model_id = s.get_str("model") or f"{mc.model}@{getattr(mc, 'revision', None) or ''}"
        cache_dtype = str(cc.cache_dtype)
        self.dtype = str(mc.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
        self.disabled = self._unsupported(vllm_config, kv_cache_config)
        if self.disabled:
            log.warning("kvstore connector disabled: %s", self.disabled)
        else:  # no more layer groups than layers
            self.layer_groups = min(self.layer_groups, len(kv_cache_config.kv_cache_groups[0].layer_names) or 1)
        self.layout = self._layout_description(kv_cache_config)
        self._block_bytes = 0 if self.disabled else self._scheduler_block_bytes(kv_cache_config)
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "hit_tokens",
                "loaded_blocks",
                "load_failed_blocks",
                "saved_blocks",
                "save_failed_blocks",
                "save_not_admitted_blocks",  # the tenant's admission (admit_after) declined them: not failures
                "dropped_save_blocks",
                "planned_recompute_blocks",
            ),
            0,
        )
        self._loop = LoopThread(f"kvstore-vllm-{role.name.lower()}")
        self._clients: list[AsyncClient] = []
        if role == KVConnectorRole.SCHEDULER:
            self._lookup_client = self._client(self.lookup_timeout)
            self._reqs: dict[str, _RequestState] = {}
        else:
            self._init_worker()

    def _client(self, timeout: float) -> AsyncClient:
        c = self.settings.client(timeout=timeout)
        self._clients.append(c)
        return c

    @staticmethod
    def _unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if len(groups) != 1:
            return f"{len(groups)} KV cache groups (only models with one attention KV cache group are supported)"
        spec = groups[0].kv_cache_spec
        if not hasattr(spec, "num_kv_heads") or getattr(spec, "sliding_window", None):
            return f"KV cache spec {type(spec).__name__} is not full attention"
        if int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1) > 1:
            return "decode context parallelism is not supported"
        return ""

    def _layout_description(self, kv_cache_config: KVCacheConfig) -> str:
        """What the scheduler can know of the layout (it never sees the tensors):
        the platform and the KV cache spec. The workers add the tensor layout
        in each block's header."""
        from vllm.platforms import current_platform

        parts = [f"vllm-v1;{current_platform.device_type};block={self.block_size}"]
        if not self.disabled:
            g = kv_cache_config.kv_cache_groups[0]
            sp = g.kv_cache_spec
            parts.append(
                f"{type(sp).__name__};heads={sp.num_kv_heads};head={sp.head_size};"
                f"head_v={getattr(sp, 'head_size_v', sp.head_size)};dtype={sp.dtype};layers={len(g.layer_names)};"
                f"quant={getattr(sp, 'kv_quant_mode', '')}"
            )
        return ";".join(parts)

    def _scheduler_block_bytes(self, kv_cache_config: KVCacheConfig) -> int:
        """One rank's kvstore blocks of an engine block as the scheduler can
        tell (the KV cache spec's page per layer, times the layers, and the
        headers); 0 if it cannot."""
        try:
            g = kv_cache_config.kv_cache_groups[0]
            groups = min(self.layer_groups, len(g.layer_names))
            return HEADER_SIZE * groups + int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
        except (AttributeError, IndexError, TypeError, ValueError):
            return 0

    def _fingerprint(self, tp_rank: int, pp_rank: int, salt: str, group: int = 0) -> str:
        lg = "" if self.layer_groups == 1 else f"lg={group}/{self.layer_groups};"
        return model_fingerprint(
            self.model_id, self.dtype, self.layout, tp_rank, self.tp_size, f"pp={pp_rank}/{self.pp_size};{lg}{salt}"
        )

    def _labels(self) -> list[tuple[str, int, int, int]]:
        """(label, TP rank, PP rank, layer group) of every set of keys a request has."""
        g = self.layer_groups
        return [
            (group_label(rank_label(t, p), i, g), t, p, i)
            for p in range(self.pp_size)
            for t in range(self.tp_size)
            for i in range(g)
        ]

    # ==============================================================================
    # Scheduler side
    # ==============================================================================

    @staticmethod
    def _request_salt(request: Request) -> str | None:
        """What besides the token ids decides the KV (None: not cacheable here)."""
        if getattr(request, "prompt_embeds", None) is not None or request.prompt_token_ids is None:
            return None
        lora = getattr(request, "lora_request", None)
        mm = [str(getattr(f, "identifier", "")) for f in (getattr(request, "mm_features", None) or [])]
        return (
            f"lora={getattr(lora, 'lora_name', '') if lora else ''};salt={request.cache_salt or ''};mm={','.join(mm)}"
        )

    def _state(self, request: Request) -> _RequestState | None:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        salt = self._request_salt(request)
        if self.disabled or salt is None:
            return None
        tokens = list(request.prompt_token_ids)
        keys = {
            label: block_keys(self._fingerprint(t, p, salt, g), tokens, self.block_size)
            for label, t, p, g in self._labels()
        }
        n = len(tokens) // self.block_size
        st = _RequestState(tokens=tokens, keys=keys, present=[False] * n, idents=self._identities(request, tokens, n))
        self._reqs[request.request_id] = st
        return st

    def _identities(self, request: Request, tokens: list[int], n: int) -> list[dict[str, Any] | None]:
        """Each full block's identity as vLLM's own KV events give it: its
        hash as an integer (the low 64 bits, vLLM's default for events), its
        parent's, its tokens, the LoRA. None where vLLM has not hashed it."""
        hashes = list(getattr(request, "block_hashes", None) or [])[:n]
        lora = getattr(request, "lora_request", None)
        out: list[dict[str, Any] | None] = []
        parent: int | None = None
        bs = self.block_size
        for i in range(n):
            if i >= len(hashes) or not isinstance(hashes[i], (bytes, bytearray)):
                out.append(None)
                parent = None
                continue
            h = int.from_bytes(hashes[i], "big") & ((1 << 64) - 1)
            out.append(
                {
                    "block_hash": h,
                    "parent_block_hash": parent,
                    "token_ids": tokens[i * bs : (i + 1) * bs],
                    "block_size": bs,
                    "lora_id": getattr(lora, "adapter_id", None) if lora else None,
                    "lora_name": getattr(lora, "name", None) if lora else None,
                }
            )
            parent = h
        return out

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._matched(request, num_computed_tokens)
        except Exception:  # fail-open: never take the scheduler down
            log.exception("kvstore lookup for request %s failed; treated as a miss", request.request_id)
            return 0, False

    def _matched(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        if st is None or (not self.do_load and not self.do_save):
            return 0, False
        if st.load_queued:
            # Asked again after a load was planned: the load failed (or the
            # request was preempted). Recompute rather than risk a retry loop.
            return 0, False
        n_blocks = len(st.present)
        if n_blocks == 0:
            return 0, False
        labels = list(st.keys)
        flat = [k for label in labels for k in st.keys[label]]
        try:
            flags = self._loop.run(
                self._lookup_client.lookup_detail(flat, self.block_size), timeout=self.lookup_timeout + 1.0
            )
        except TimeoutError:
            flags = [False] * len(flat)
        self.stats["lookups"] += 1
        st.present = [all(flags[r * n_blocks + i] for r in range(len(labels))) for i in range(n_blocks)]
        hit = 0
        while hit < n_blocks and st.present[hit]:
            hit += 1
        # Never the whole prompt: the engine computes at least the last token.
        hit = min(hit, (len(st.tokens) - 1) // self.block_size)
        start = num_computed_tokens // self.block_size
        if not self.do_load or hit <= start:
            st.load_start = st.load_end = 0
            return 0, False
        st.load_deadline_s = None
        if self.planner is not None:
            # Layerwise: the prompt's tokens after the hit compute while the hit loads.
            overlap = len(st.tokens) - hit * self.block_size if self.layerwise else 0
            plan = self._plan(hit - start, overlap)
            who = f"request {request.request_id}"
            self.stats["planned_recompute_blocks"] += told_recompute(log, plan, hit - start, who, "hit blocks")
            hit = start + plan.blocks
            st.load_deadline_s = plan.deadline_s
            if hit <= start:
                st.load_start = st.load_end = 0
                return 0, False
        st.load_start, st.load_end = start, hit
        return (hit - start) * self.block_size, self.load_async

    def _plan(self, blocks: int, overlap_tokens: int = 0) -> LoadPlan:
        """The planner's choice for ``blocks`` hit blocks: this process's
        measured bandwidth and the tenant's read limit against the engine's
        prefill throughput (``overlap_tokens``: computed while a layerwise load runs)."""
        assert self.planner is not None
        ranks = self.tp_size * self.pp_size
        return self.planner.plan(
            blocks,
            self.block_size,
            self._block_bytes * ranks,
            process_bandwidth(),
            self._read_limit.get(),
            overlap_tokens,
        )

    def _ask_read_limit(self) -> float | None:
        try:
            return self._loop.run(self._lookup_client.read_limit(), timeout=self.lookup_timeout + 1.0)
        except TimeoutError:
            return None

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.load_queued:
            return
        # vLLM now counts these tokens as coming from kvstore: the load must be
        # queued whatever happens (blocks it cannot fill are reported as errors).
        n = num_external_tokens // self.block_size
        start = st.load_start
        ids = blocks.get_block_ids()[0]
        st.load_end = start + n
        st.block_ids = list(ids)
        st.load_queued = True
        st.saved_upto = max(st.saved_upto, st.load_end)
        self.stats["hit_tokens"] += n * self.block_size
        log.info("kvstore: request %s: %d tokens from kvstore", request.request_id, n * self.block_size)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata(async_loads=self.load_async)
        try:
            self._build(scheduler_output, meta)
        except Exception:  # fail-open: a bookkeeping bug costs cache hits, not the engine
            log.exception("kvstore: building the step's transfers failed; no transfers this step")
            meta = KVStoreConnectorMetadata(async_loads=self.load_async)
        if self.planner is not None:
            self._time_steps(scheduler_output, bool(meta.loads) and not self.load_async)
        return meta

    def _time_steps(self, so: SchedulerOutput, loads: bool) -> None:
        """The engine's prefill throughput, measured: a step of at least
        PREFILL_MIN_TOKENS scheduled tokens, and the time to the next step's
        scheduling (its forward pass and the scheduler's turn), if that is
        under STEP_MAX_S (longer: the engine was idle, not computing). A step
        that loads before or beside its forward pass (``loads``: sync and
        layerwise modes) is not counted: its time is partly the load's, and
        counting it would make slow loads look like slow prefill, which makes
        loading look better. It starts from the configured ``prefill_tokens_per_s``."""
        assert self.planner is not None
        now = time.monotonic()
        tokens = 0 if loads else int(getattr(so, "total_num_scheduled_tokens", 0) or 0)
        last, self._last_step = self._last_step, (now, tokens)
        if last is not None and last[1] >= PREFILL_MIN_TOKENS and 0 < now - last[0] < STEP_MAX_S:
            self.planner.observe_prefill(last[1], now - last[0])

    def _build(self, so: SchedulerOutput, meta: KVStoreConnectorMetadata) -> None:
        bs = self.block_size
        for st_id, st in self._reqs.items():
            if st.load_queued and st.load_end > st.load_start:
                meta.loads.append(
                    BlockTransfer(
                        st_id,
                        st.block_ids[st.load_start : st.load_end],
                        {label: keys[st.load_start : st.load_end] for label, keys in st.keys.items()},
                        deadline_s=st.load_deadline_s,
                    )
                )
                st.load_end = st.load_start  # queued once
        if not self.do_save:
            return
        progress: list[tuple[str, int]] = []
        for new in so.scheduled_new_reqs:
            found = self._reqs.get(new.req_id)
            if found is None:
                continue
            found.block_ids = list(new.block_ids[0])
            progress.append((new.req_id, new.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            found = self._reqs.get(req_id)
            if found is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                found.block_ids = list(new_ids[0])
            elif new_ids is not None:
                found.block_ids.extend(new_ids[0])
            progress.append((req_id, cached.num_computed_tokens[i]))
        for req_id, computed in progress:
            st = self._reqs[req_id]
            done = min(computed + so.num_scheduled_tokens.get(req_id, 0), len(st.tokens)) // bs
            todo = [i for i in range(st.saved_upto, min(done, len(st.block_ids))) if not st.present[i]]
            st.saved_upto = max(st.saved_upto, done)
            if todo:
                meta.saves.append(
                    BlockTransfer(
                        req_id,
                        [st.block_ids[i] for i in todo],
                        {lb: [k[i] for i in todo] for lb, k in st.keys.items()},
                        [st.idents[i] if i < len(st.idents) else None for i in todo],
                    )
                )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy the blocks out in wait_for_save, so vLLM may free them now.
        self._reqs.pop(request.request_id, None)
        return False, None

    # ==============================================================================
    # Worker side
    # ==============================================================================

    def _init_worker(self) -> None:
        self._layers: list[_Layer] = []
        self._by_name: dict[str, _Layer] = {}
        self._groups: list[_Group] = []
        self._label = ""
        self._load_client = self._client(self.load_timeout)
        self._save_client = self._client(self.save_timeout)
        self._lock = threading.Lock()
        self._inflight_loads: dict[str, concurrent.futures.Future[set[int]]] = {}
        self._layerwise: list[_LayerwiseLoad] = []  # this step's layerwise loads (forward thread only)
        self._idle_step = False
        self._errors: set[int] = set()
        self._pending_save_bytes = 0
        self._pending_saves: set[concurrent.futures.Future[Any]] = set()
        # vLLM's in-process engine (LLM(...)) has no shutdown hook: flush the
        # saves still on their way at interpreter exit (bounded by save_timeout).
        atexit.register(self.shutdown)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self._register(kv_caches)
        except Exception as e:
            self.disabled = f"cannot use the registered KV caches: {e}"
            log.exception("kvstore connector disabled: %s", self.disabled)

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        if self.disabled:
            return
        rank = rank_label(get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)
        num_blocks = int(self._kv_cache_config.num_blocks)
        order = [n for n in self._kv_cache_config.kv_cache_groups[0].layer_names if n in kv_caches]
        order += [n for n in kv_caches if n not in order]
        if len(order) < self.layer_groups:
            raise ValueError(f"layer_groups is {self.layer_groups} but this worker has {len(order)} attention layers")
        layers, desc = [], []
        for name in order:
            t = kv_caches[name]
            dims = [d for d, size in enumerate(t.shape) if size == num_blocks]
            if len(dims) != 1:
                raise ValueError(f"layer {name}: shape {tuple(t.shape)} has no single dimension of {num_blocks} blocks")
            d = dims[0]
            shape = tuple(int(x) for i, x in enumerate(t.shape) if i != d)
            layers.append(_Layer(name, t, d, shape, math.prod(shape) * t.element_size()))
            desc.append(f"{name}:{shape}:{d}:{t.dtype}")
        # Layer groups: contiguous runs of layers, as even in count as they divide.
        g = self.layer_groups
        bounds = [len(layers) * i // g for i in range(g + 1)]
        for i in range(g):
            members = layers[bounds[i] : bounds[i + 1]]
            at = HEADER_SIZE
            for layer in members:
                layer.group, layer.offset = i, at
                at += layer.nbytes
            what = ";".join(desc) if g == 1 else ";".join(desc) + f";group={i}/{g}"
            header = HEADER_MAGIC + hashlib.blake2b(what.encode(), digest_size=8).digest()
            self._groups.append(_Group(members, header, at))
        self._layers = layers
        self._by_name = {layer.name: layer for layer in layers}
        self._label = rank
        first = layers[0]
        log.info(
            "kvstore connector (%s): %d layers in %d group(s), layer block %s %s (block dim %d of %s), "
            "%d bytes per engine block",
            rank,
            len(layers),
            g,
            first.block_shape,
            first.tensor.dtype,
            first.block_dim,
            tuple(first.tensor.shape),
            sum(grp.nbytes for grp in self._groups),
        )

    def _glabel(self, group: int) -> str:
        return group_label(self._label, group, self.layer_groups)

    def _host_buffer(self, group: int) -> torch.Tensor:
        pin = any(layer.tensor.is_cuda for layer in self._layers)
        return torch.empty(self._groups[group].nbytes, dtype=torch.uint8, pin_memory=pin)

    @staticmethod
    def _view(buf: torch.Tensor, layer: _Layer) -> torch.Tensor:
        return buf[layer.offset : layer.offset + layer.nbytes].view(layer.tensor.dtype).view(layer.block_shape)

    def _copy_out(self, block_id: int, group: int) -> torch.Tensor:
        buf = self._host_buffer(group)
        grp = self._groups[group]
        buf[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(grp.header), dtype=torch.uint8))
        for layer in grp.layers:
            self._view(buf, layer).copy_(layer.tensor.select(layer.block_dim, block_id))
        return buf

    def _copy_layer_in(self, buf: torch.Tensor, block_id: int, layer: _Layer) -> None:
        layer.tensor.select(layer.block_dim, block_id).copy_(self._view(buf, layer), non_blocking=False)

    def _valid(self, key: str, buf: torch.Tensor, n: int | None, group: int) -> bool:
        """Whether a read of ``n`` bytes into ``buf`` is a block of this layout's ``group``."""
        grp = self._groups[group]
        if n != grp.nbytes:
            if n is not None:
                log.warning("kvstore block %s is %d bytes, expected %d: not loaded", key, n, grp.nbytes)
            return False
        if bytes(buf[:HEADER_SIZE].numpy()) != grp.header:
            log.warning("kvstore block %s was stored with another KV layout: not loaded", key)
            return False
        return True

    def _ready(self) -> bool:
        return not self.disabled and bool(self._layers) and self.has_connector_metadata()

    # -- loads -------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # vLLM runs a step without a forward pass (no attention metadata) when no
        # request can run, e.g. all wait for their KV: get_finished may then wait.
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None
        if not self._ready():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        for load in meta.loads:
            if self.layerwise:
                self._start_layerwise(load)
            elif meta.async_loads:
                fut = self._loop.submit(self._load(load))
                with self._lock:
                    self._inflight_loads[load.req_id] = fut
            else:
                try:
                    failed = self._loop.run(self._load(load), timeout=self.load_timeout + 1.0)
                except TimeoutError:
                    failed = set(load.block_ids)
                with self._lock:
                    self._errors |= failed

    async def _load(self, load: BlockTransfer) -> set[int]:
        """Load one request's blocks into the paged cache, an engine block at
        a time (all its layer groups); returns the block ids that failed."""
        import asyncio

        keys = [load.keys.get(self._glabel(g), []) for g in range(len(self._groups))]
        if any(len(k) != len(load.block_ids) for k in keys):
            return set(load.block_ids)
        # (block index, group) in the prefix's order: a load cut by its deadline keeps a whole prefix.
        items = [(i, g) for i in range(len(load.block_ids)) for g in range(len(self._groups))]
        landed: dict[int, int] = {}  # block index -> groups copied in
        pool = self._load_buffers.pop() if self._load_buffers else {}
        # A planned load stops at its deadline (get_prefix): what did not arrive is recomputed.
        until = None if load.deadline_s is None else time.monotonic() + load.deadline_s
        cut = False

        async def part(chunk: list[tuple[int, int]]) -> None:
            # One get_many_into per chunk: over NIXL one control call and one transfer.
            nonlocal cut
            bufs, used = [], dict.fromkeys(range(len(self._groups)), 0)
            for _, g in chunk:
                mine = pool.setdefault(g, [])
                if used[g] == len(mine):
                    mine.append(self._host_buffer(g))
                bufs.append(mine[used[g]])
                used[g] += 1
            part_keys, arrays = [keys[g][i] for i, g in chunk], [b.numpy() for b in bufs]
            got: list[int | None]
            if until is None:
                got = await self._load_client.get_many_into(part_keys, arrays)
            else:
                arrived = await self._load_client.get_prefix(part_keys, arrays, max(0.0, until - time.monotonic()))
                got = [len(a) for a in arrays[:arrived]] + [None] * (len(chunk) - arrived)  # (headers checked below)
                cut = arrived < len(chunk)
            for (i, g), key, buf, n in zip(chunk, part_keys, bufs, got, strict=True):
                if self._valid(key, buf, n, g):
                    for layer in self._groups[g].layers:
                        self._copy_layer_in(buf, load.block_ids[i], layer)
                    landed[i] = landed.get(i, 0) + 1

        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.load_timeout):
                for at in range(0, len(items), self.load_concurrency):
                    if cut:
                        break
                    await part(items[at : at + self.load_concurrency])
            if not cut:  # not after a timeout or a deadline: a read may still land in them
                self._load_buffers.append(pool)
        except TimeoutError:
            log.warning("kvstore: loading request %s timed out after %s s", load.req_id, self.load_timeout)
        except Exception:
            log.exception("kvstore: loading request %s failed", load.req_id)
        done = {load.block_ids[i] for i, n in landed.items() if n == len(self._groups)}
        failed = set(load.block_ids) - done
        log.debug(
            "kvstore: request %s: %d blocks loaded, %d failed, in %.3f s",
            load.req_id,
            len(done),
            len(failed),
            time.monotonic() - t0,
        )
        self.stats["loaded_blocks"] += len(done)
        self.stats["load_failed_blocks"] += len(failed)
        return failed

    # -- layerwise loads: the forward pass starts before the prefix is in ---------

    def _start_layerwise(self, load: BlockTransfer) -> None:
        """Start loading ``load`` a layer group after another (each group's
        blocks in order, through get_prefix under the load's deadline), into
        staging buffers; ``wait_for_layer_load`` copies a layer in once its
        group has arrived."""
        groups = len(self._groups)
        budget = self.load_timeout if load.deadline_s is None else min(load.deadline_s, self.load_timeout)
        lw = _LayerwiseLoad(
            load,
            time.monotonic() + budget,
            [concurrent.futures.Future() for _ in range(groups)],
            [[self._host_buffer(g) for _ in load.block_ids] for g in range(groups)],
        )
        lw.task = self._loop.submit(self._load_layerwise(lw))
        self._layerwise.append(lw)

    async def _load_layerwise(self, lw: _LayerwiseLoad) -> None:
        load, upto = lw.load, len(lw.load.block_ids)
        try:
            for g, bufs in enumerate(lw.bufs):
                keys = load.keys.get(self._glabel(g), [])
                n = 0
                if len(keys) == len(load.block_ids) and upto > 0:
                    arrays = [b.numpy() for b in bufs[:upto]]
                    n = await self._load_client.get_prefix(keys[:upto], arrays, max(0.0, lw.until - time.monotonic()))
                    n = next((i for i in range(n) if not self._valid(keys[i], bufs[i], len(arrays[i]), g)), n)
                upto = min(upto, n)  # a block counts only if every group of it arrived
                lw.arrived[g].set_result(upto)
        except BaseException:
            log.exception("kvstore: layerwise load of request %s failed", load.req_id)
            raise
        finally:
            for fut in lw.arrived:
                if not fut.done():
                    fut.set_result(0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._layerwise:
            return  # whole blocks: loaded before the forward (sync) or before the request runs (async)
        layer = self._by_name.get(layer_name)
        if layer is None:
            return
        for lw in self._layerwise:
            if layer_name in lw.copied:
                continue
            try:
                n = lw.arrived[layer.group].result(timeout=max(0.0, lw.until - time.monotonic()) + 1.0)
            except concurrent.futures.TimeoutError:
                n = 0  # (the loading task sets every group's count when it ends; this is its safety net)
            for i in range(n):
                self._copy_layer_in(lw.bufs[layer.group][i], lw.load.block_ids[i], layer)
            lw.copied.add(layer_name)
            lw.upto = n if lw.upto is None else min(lw.upto, n)

    def _finish_layerwise(self) -> None:
        """After the forward pass: a layerwise load's blocks that some layer
        did not get (cut by the deadline, missing, or a layer the forward
        never waited for) are load errors; the load's task is stopped."""
        if not self._layerwise:
            return
        loads, self._layerwise = self._layerwise, []
        for lw in loads:
            if lw.task is not None:
                lw.task.cancel()  # staging buffers only: nothing more reaches the paged cache
            every = len(lw.copied) == len(self._layers)
            upto = (lw.upto or 0) if every else 0
            failed = set(lw.load.block_ids[upto:])
            with self._lock:
                self._errors |= failed
            self.stats["loaded_blocks"] += upto
            self.stats["load_failed_blocks"] += len(failed)
            log.debug("kvstore: request %s: %d blocks loaded layerwise, %d failed", lw.load.req_id, upto, len(failed))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.role != KVConnectorRole.WORKER or self.disabled:
            return None, None
        self._finish_layerwise()
        done: set[str] = set()
        with self._lock:
            inflight = list(self._inflight_loads.values())
        if inflight and self._idle_step:
            # An idle engine loop spins through steps holding the GIL, which
            # starves the loading thread (each socket read must win the GIL
            # back: the convoy effect made a 0.4 s load take 12 s). Nothing
            # else runs this step, so wait here, GIL released, for a load.
            concurrent.futures.wait(inflight, timeout=IDLE_WAIT, return_when=concurrent.futures.FIRST_COMPLETED)
        with self._lock:
            for req_id, fut in list(self._inflight_loads.items()):
                if not fut.done():
                    continue
                del self._inflight_loads[req_id]
                done.add(req_id)
                try:
                    self._errors |= fut.result()
                except BaseException:  # cancelled or crashed: every block of it failed
                    log.exception("kvstore: load task of request %s ended abnormally", req_id)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.role != KVConnectorRole.WORKER:
            return set()
        self._finish_layerwise()
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    # -- saves -------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        if not self._ready():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            return
        try:
            self._save(meta.saves)
        except Exception:  # fail-open
            log.exception("kvstore: saving this step's blocks failed")

    def _save(self, saves: list[BlockTransfer]) -> None:
        items: list[tuple[str, torch.Tensor]] = []
        metas: list[dict[str, Any] | None] = []
        block_nbytes = sum(grp.nbytes for grp in self._groups)
        nbytes = 0
        for save in saves:
            keys = [save.keys.get(self._glabel(g), []) for g in range(len(self._groups))]
            idents = save.metas or [None] * len(save.block_ids)
            for i, (block_id, ident) in enumerate(zip(save.block_ids, idents, strict=True)):
                if self._pending_save_bytes + block_nbytes > self.max_pending_save_bytes:
                    self.stats["dropped_save_blocks"] += 1
                    continue
                for g, group_keys in enumerate(keys):
                    items.append((group_keys[i], self._copy_out(block_id, g)))
                    metas.append(ident if g == 0 else None)  # the engine's identity: on the first group's block
                self._pending_save_bytes += block_nbytes
                nbytes += block_nbytes
        if not items:
            return
        blocks = len(items) // len(self._groups)
        ids = metas if any(m is not None for m in metas) else None
        fut = self._loop.submit(self._save_client.put_many_detail([(k, b.numpy()) for k, b in items], ids))
        with self._lock:
            self._pending_saves.add(fut)

        def finished(f: concurrent.futures.Future[list[int | None]]) -> None:
            with self._lock:
                self._pending_saves.discard(f)
                self._pending_save_bytes -= nbytes
            done = f.result() if not f.cancelled() and f.exception() is None else [None] * len(items)
            g = len(self._groups)
            groups = [done[i : i + g] for i in range(0, len(done), g)]  # an engine block: all its groups
            saved = sum(all(st in (200, 201) for st in grp) for grp in groups)
            declined = sum(None not in grp and NOT_ADMITTED in grp for grp in groups)
            self.stats["saved_blocks"] += saved
            self.stats["save_not_admitted_blocks"] += declined
            self.stats["save_failed_blocks"] += blocks - saved - declined

        fut.add_done_callback(finished)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the saves handed to the network so far are done (True) or
        ``timeout`` passes (False)."""
        if self.role != KVConnectorRole.WORKER:
            return True
        with self._lock:
            pending = list(self._pending_saves)
        _, not_done = concurrent.futures.wait(pending, timeout=timeout)
        return not not_done

    def shutdown(self) -> None:
        if self._loop.closed:
            return
        if self.role == KVConnectorRole.WORKER and not self.flush(self.save_timeout):
            log.warning("kvstore: shutting down with saves still in flight")
        log.info("kvstore connector (%s) stats: %s", self.role.name.lower(), self.stats)
        self._loop.close(self._clients)

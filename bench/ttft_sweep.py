"""TTFT against the storage bandwidth, with a real engine: when does loading a hit pay?

``kvstore-bench ttft --engine vllm`` starts a kvstore daemon on 127.0.0.1 and,
one engine process after another (vLLM's CPU backend, the kvstore connector,
vLLM's own prefix caching off so that a hit can only come from kvstore),
measures the time to first token of a multi-turn prompt: a prefix kvstore
holds (the conversation so far) and a suffix it has never seen (the new
turn), for each storage bandwidth of the sweep, set as the tenant's QoS read
limit. Four ways to serve it:

* ``recompute``: the connector only saves (``kv_role`` ``kv_producer``): the
  engine computes the whole prompt;
* ``load-all``: every hit block is loaded, whatever the bandwidth (the
  connector without ``prefill_tokens_per_s``);
* ``planner``: the connector's load planner decides (``prefill_tokens_per_s``
  from the recompute engine's own figure, then what the engine measures);
* ``layerwise``: the planner, and the prefix loaded layer group by layer
  group while the forward pass runs (``load_mode`` ``layerwise``).

Each point is the median of ``--runs`` prompts, after one prompt at that
bandwidth that is not counted (the planner learns from it: the tenant's read
limit and the load it measured). A new suffix for every prompt: its blocks
are saved, and a later prompt must not find them. The report gives, per
bandwidth, the planner's TTFT over min(recompute, load-all) (the target:
at most 1.1) and layerwise's over the planner's; ``--json`` and ``--png``
write them. Example (deploy/setup-engines.sh first)::

    kvstore-bench ttft --engine vllm --json ttft.json --png ttft.png

The model is a random-weight Llama built here (engine_ttft.build_llama):
what matters is its prefill time and its KV bytes per token, both printed.

The engines run in ``--engine-python``, an environment with vLLM and this
package installed (deploy/setup-engines.sh makes ``.venv-engines`` in a
checkout, with both): each mode's engine is ``python -m
kvstore_bench.ttft_sweep --child`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .plots import matplotlib_missing

BLOCK = 32  # vLLM's CPU attention needs block sizes that are multiples of 32
MODES = ("recompute", "load-all", "planner", "layerwise")
READ_LIMIT_SETTLE_S = 10.5  # the connector asks for the tenant's read limit every 10 s (planner.READ_LIMIT_TTL_S)
TARGET = 1.1


# This module by the name the engine's interpreter imports it (kvstore_bench when installed).
CHILD_MODULE = f"{__package__ or 'kvstore_bench'}.ttft_sweep"
DEFAULT_ENGINE_PYTHON = Path(".venv-engines") / "bin" / "python"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-bench ttft --engine vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix-tokens", type=int, default=1024, help="tokens kvstore holds (default 1024)")
    p.add_argument("--suffix-tokens", type=int, default=256, help="new tokens per prompt (default 256)")
    p.add_argument(
        "--bandwidths",
        default="none,200,100,50,25,12",
        help="the tenant's read limits to sweep, MB/s, 'none' for no limit (default none,200,100,50,25,12)",
    )
    p.add_argument("--runs", type=int, default=3, help="prompts measured per point; figures are medians (default 3)")
    p.add_argument("--modes", default=",".join(MODES), help=f"which of {','.join(MODES)} (default all)")
    p.add_argument("--layer-groups", type=int, default=4, help="the layerwise engine's layer_groups (default 4)")
    p.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8: head_dim 64)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--intermediate", type=int, default=1408, help="MLP width (default 1408)")
    p.add_argument(
        "--engine-python",
        type=Path,
        default=DEFAULT_ENGINE_PYTHON,
        help="the Python of an environment with vLLM and kvstore-server installed, which runs the engines "
        f"(default {DEFAULT_ENGINE_PYTHON}, relative to the current directory: deploy/setup-engines.sh makes it)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON here")
    p.add_argument(
        "--png", type=Path, metavar="PATH", help="write a plot of TTFT against the bandwidth here (needs matplotlib)"
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if a.prefix_tokens % BLOCK or a.suffix_tokens % BLOCK or a.prefix_tokens < BLOCK or a.suffix_tokens < BLOCK:
        p.error(f"argument --prefix-tokens/--suffix-tokens: positive multiples of {BLOCK}")
    if a.runs < 1:
        p.error("argument --runs: at least 1")
    if not 1 <= a.layer_groups <= a.layers:
        p.error(f"argument --layer-groups: 1 to --layers ({a.layers})")
    try:
        a.limits = [None if b.strip() == "none" else float(b) for b in a.bandwidths.split(",") if b.strip()]
    except ValueError:
        p.error(f"argument --bandwidths: MB/s figures or 'none', got {a.bandwidths!r}")
    if not a.limits or any(x is not None and x <= 0 for x in a.limits):
        p.error("argument --bandwidths: positive MB/s figures or 'none'")
    a.mode_list = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not a.mode_list or any(m not in MODES for m in a.mode_list):
        p.error(f"argument --modes: a comma-separated subset of {','.join(MODES)}")
    if a.png is not None and (why := matplotlib_missing()) is not None:
        p.error(f"argument --png: {why}")
    if not a.engine_python.exists():
        p.error(f"argument --engine-python: {a.engine_python} does not exist (deploy/setup-engines.sh makes it)")
    return a


# -- the parent: a daemon, an engine process per mode, the report -------------------------


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from .daemon import Kvstore
    from .harness import Processes

    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-sweep-") as tmp:
        root = Path(tmp)
        try:
            (root / "kv").mkdir()
            kv = Kvstore(procs, root / "kv", "fsync")
            kv.start(1)
            token = kv.create_tenant("bench", "direct")
            spec = {
                "endpoint": f"http://127.0.0.1:{kv.port}",
                "token": token,
                "admin_token": kv.admin_token,
                "tenant": "bench",
                "model_dir": str(root / "model"),
                "model": {
                    "hidden": a.hidden,
                    "layers": a.layers,
                    "heads": a.heads,
                    "kv_heads": a.kv_heads,
                    "intermediate": a.intermediate,
                },
                "prefix_tokens": a.prefix_tokens,
                "suffix_tokens": a.suffix_tokens,
                "limits": a.limits,
                "runs": a.runs,
                "layer_groups": a.layer_groups,
                "prefill_tokens_per_s": 0.0,
            }
            results: dict[str, Any] = {}
            for mode in a.mode_list:
                spec["mode"] = mode
                results[mode] = _child(a.engine_python, root, spec)
                if mode == "recompute":  # what an operator would configure: the engine's measured prefill
                    tps = [r["prompt_tokens"] / r["ttft_s"] for r in results[mode]["points"]]
                    spec["prefill_tokens_per_s"] = statistics.median(tps)
        finally:
            procs.stop_all()
    doc = _report(a, results)
    if a.json:
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    if a.png:
        write_png(a.png, doc)
    return 0


def _child(python: Path, root: Path, spec: dict[str, Any]) -> dict[str, Any]:
    mode = spec["mode"]
    spec_path, out_path, log_path = root / f"{mode}.spec.json", root / f"{mode}.out.json", root / f"{mode}.log"
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    print(f"{mode}: engine starting", flush=True)
    with log_path.open("wb") as log:
        proc = subprocess.run(
            [str(python), "-m", CHILD_MODULE, "--child", str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if proc.returncode != 0:
        sys.stderr.write(log_path.read_text()[-8000:])
        raise SystemExit(f"the {mode} engine exited {proc.returncode}")
    out: dict[str, Any] = json.loads(out_path.read_text())
    for pt in out["points"]:
        print(
            f"{mode:>10}: limit {_limit_label(pt['limit_mb_s']):>5} MB/s: TTFT {pt['ttft_s']:.3f} s, "
            f"{pt['loaded_tokens']} tokens loaded",
            flush=True,
        )
    print(f"{mode}: done in {time.monotonic() - t0:.0f} s", flush=True)
    return out


def _limit_label(limit: float | None) -> str:
    return "none" if limit is None else f"{limit:g}"


def _report(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    by_mode = {m: {_limit_label(p["limit_mb_s"]): p for p in r["points"]} for m, r in results.items()}
    rows = []
    for limit in a.limits:
        key = _limit_label(limit)
        row: dict[str, Any] = {"limit_mb_s": limit}
        for m in results:
            row[m] = by_mode[m][key]["ttft_s"]
        if {"recompute", "load-all", "planner"} <= set(results):
            row["planner_over_best"] = row["planner"] / min(row["recompute"], row["load-all"])
        if {"planner", "layerwise"} <= set(results):
            row["layerwise_over_planner"] = row["layerwise"] / row["planner"]
            if {"recompute", "load-all"} <= set(results):
                row["layerwise_over_best"] = row["layerwise"] / min(row["recompute"], row["load-all"])
        rows.append(row)
    first = next(iter(results.values()))
    doc = {
        "engine": first["engine"],
        "model": first["model"],
        "prefix_tokens": a.prefix_tokens,
        "suffix_tokens": a.suffix_tokens,
        "prefix_kv_mb": first["model"]["kv_bytes_per_token"] * a.prefix_tokens / 1e6,
        "runs": a.runs,
        "rows": rows,
        "modes": results,
        "target": f"planner <= {TARGET} x min(recompute, load-all) at every bandwidth",
        "target_met": all(r.get("planner_over_best", 0) <= TARGET for r in rows),
    }
    print(
        f"\nmodel ~{first['model']['params_m']} M parameters, prefix {a.prefix_tokens} tokens = "
        f"{doc['prefix_kv_mb']:.1f} MB of KV, suffix {a.suffix_tokens} tokens; TTFT medians of {a.runs}, seconds"
    )
    head = ["limit MB/s", *results, "planner/best", "layerwise/planner"]
    print(" | ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = [_limit_label(r["limit_mb_s"]), *(f"{r[m]:.3f}" for m in results)]
        cells += [f"{r['planner_over_best']:.2f}" if "planner_over_best" in r else "-"]
        cells += [f"{r['layerwise_over_planner']:.2f}" if "layerwise_over_planner" in r else "-"]
        print(" | ".join(f"{c:>12}" for c in cells))
    if any("planner_over_best" in r for r in rows):
        verdict = "met" if doc["target_met"] else "MISSED"
        print(f"target (planner <= {TARGET} x the better of recompute and load-all): {verdict}")
    return doc


def write_png(path: Path, doc: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limited = [r["limit_mb_s"] for r in doc["rows"] if r["limit_mb_s"] is not None]
    none_x = 2 * max(limited) if limited else 1.0  # "no limit", drawn right of the highest limit
    xs = [none_x if r["limit_mb_s"] is None else r["limit_mb_s"] for r in doc["rows"]]
    fig, ax = plt.subplots(figsize=(8, 5))
    for mode in doc["modes"]:
        ax.plot(xs, [r[mode] for r in doc["rows"]], marker="o", label=mode)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(xs)
    ax.set_xticklabels(["none" if r["limit_mb_s"] is None else f"{r['limit_mb_s']:g}" for r in doc["rows"]])
    ax.set_xlabel("storage bandwidth: the tenant's read limit, MB/s")
    ax.set_ylabel("time to first token, s (median)")
    ax.set_title(
        f"vLLM CPU, prefix {doc['prefix_tokens']} tokens ({doc['prefix_kv_mb']:.0f} MB KV) + "
        f"{doc['suffix_tokens']} new tokens"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


# -- a child: one engine, one mode, every bandwidth -------------------------------------------


def _http(url: str, token: str, method: str = "GET", doc: Any = None) -> Any:
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {token}"})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


def child(spec_path: Path, out_path: Path) -> int:
    from .engine_ttft import ENGINE_ENV, build_llama, wait_for_blocks

    spec = json.loads(spec_path.read_text())
    os.environ.update(ENGINE_ENV)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    mode, m = spec["mode"], spec["model"]
    prefix_n, suffix_n = spec["prefix_tokens"], spec["suffix_tokens"]
    max_len = prefix_n + suffix_n + BLOCK
    model_dir = Path(spec["model_dir"])
    if not (model_dir / "config.json").exists():
        build_llama(
            model_dir,
            hidden=m["hidden"],
            intermediate=m["intermediate"],
            layers=m["layers"],
            heads=m["heads"],
            kv_heads=m["kv_heads"],
            max_positions=max_len,
        )
    endpoint, token = spec["endpoint"], spec["token"]

    def blocks() -> int:
        return int(_http(endpoint + "/v1/stats", token)["blocks"])

    def set_limit(limit_mb_s: float | None) -> None:
        rate = None if limit_mb_s is None else int(limit_mb_s * 1e6)
        doc = {"qos": {"read_bytes_per_s": rate}}
        _http(f"{endpoint}/v1/admin/tenants/{spec['tenant']}", spec["admin_token"], "PATCH", doc)

    extra: dict[str, Any] = {"endpoints": endpoint, "token": token, "model": "ttft-sweep@1"}
    planned = mode in ("planner", "layerwise")
    if planned:
        extra["prefill_tokens_per_s"] = spec["prefill_tokens_per_s"]
    if mode == "layerwise":
        extra["load_mode"] = "layerwise"
        extra["layer_groups"] = spec["layer_groups"]
    kvt = KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore_client.adapters.vllm",
        kv_role="kv_producer" if mode == "recompute" else "kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        enforce_eager=True,
        block_size=BLOCK,
        enable_prefix_caching=False,  # a hit can only come from kvstore
        kv_transfer_config=kvt,
        seed=0,
    )
    one = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(MODES.index(mode))
    vocab = 300
    prefix = [rng.randrange(2, vocab) for _ in range(prefix_n)]
    groups = spec["layer_groups"] if mode == "layerwise" else 1

    def ttft(tokens: list[int]) -> tuple[float, int]:
        before = blocks()
        t = time.monotonic()
        out = llm.generate([{"prompt_token_ids": tokens}], one, use_tqdm=False)[0]
        took = time.monotonic() - t
        # The new suffix's blocks are saved in the background: let them land before the next prompt.
        wait_for_blocks(blocks, before + (len(tokens) // BLOCK - prefix_n // BLOCK) * groups, timeout=300)
        return took, int(out.num_cached_tokens or 0)

    def prompt() -> list[int]:
        return prefix + [rng.randrange(2, vocab) for _ in range(suffix_n)]

    set_limit(None)
    warm = [rng.randrange(2, vocab) for _ in range(4 * BLOCK)]
    llm.generate([{"prompt_token_ids": warm}], one, use_tqdm=False)  # first-call costs
    before = blocks()
    llm.generate([{"prompt_token_ids": prompt()}], one, use_tqdm=False)  # stores the prefix (and a suffix)
    wait_for_blocks(blocks, before + (prefix_n + suffix_n) // BLOCK * groups, timeout=300)
    points = []
    for limit in spec["limits"]:
        set_limit(limit)
        if planned:
            time.sleep(READ_LIMIT_SETTLE_S)
        ttft(prompt())  # not counted: the planner learns the bandwidth at this limit
        runs = [ttft(prompt()) for _ in range(spec["runs"])]
        points.append(
            {
                "limit_mb_s": limit,
                "ttft_s": statistics.median(r[0] for r in runs),
                "loaded_tokens": int(statistics.median(r[1] for r in runs)),
                "prompt_tokens": prefix_n + suffix_n,
                "runs": [{"ttft_s": r[0], "loaded_tokens": r[1]} for r in runs],
            }
        )
    set_limit(None)
    params = m["layers"] * (2 * m["hidden"] ** 2 + 2 * m["hidden"] * (m["hidden"] // m["heads"]) * m["kv_heads"])
    params += m["layers"] * 3 * m["hidden"] * m["intermediate"]
    kv_per_token = m["layers"] * 2 * m["kv_heads"] * (m["hidden"] // m["heads"]) * 4
    import vllm

    doc = {
        "mode": mode,
        "engine": f"vllm {vllm.__version__} (CPU)",
        "model": {**m, "params_m": round(params / 1e6), "dtype": "float32", "kv_bytes_per_token": kv_per_token},
        "prefill_tokens_per_s": spec["prefill_tokens_per_s"] if planned else None,
        "layer_groups": groups,
        "points": points,
    }
    out_path.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(Path(sys.argv[2]), Path(sys.argv[3])))
    sys.exit(main())

"""The figures of ``kvstore-bench replay`` (``replay.py``, ``replayer.py``): a table, JSON and a chart.

Every ratio is of the input tokens of the requests replayed:

* ``token_hit_ratio``: tokens of the blocks loaded whole from the start of
  each request's chain, over all input tokens (``lookup_token_hit_ratio``:
  what the lookups found, before the loads);
* ``unbounded_token_hit_ratio``, ``lru_token_hit_ratio``,
  ``belady_token_hit_ratio``: the same requests through the reference caches
  of ``trace.py``, LRU and Belady holding ``blocks_held`` blocks (what the
  tenant held of the run's blocks at the end, listed from the daemon);
* ``tiers``: the hit ratio split by where the daemon served the blocks, G3
  (local disk or memory) and G4 (records read from the object tier,
  ``kvstore_tier_reads_total``), and the misses: g3 + g4 + miss = 1. The
  client cannot tell per block where it came from, so g4 is the hit ratio
  times the daemon's tier reads over the run per block loaded (none when
  the daemon's /metrics did not answer).

Against a fleet (``--fleet``) the daemon's figures are the members' summed:
``blocks_held`` is the run's distinct keys listed on every member (each
member's count in ``fleet``), the /metrics counters (tier reads, bytes
written) are summed over the members known at the start, and a fleet
started here has its nodes' CPU summed. The references are still one cache
of ``blocks_held`` blocks, where a fleet's quota is each node's on its own
shard: the comparison is approximate (a note says so).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness import percentile_or_none
from .plots import save_png
from .replayer import Replayed, ReplayOptions, Sample, Served
from .sizing import fmt_bytes
from .trace import References, Request, shape, token_hit_ratio
from .ttft import recompute_seconds

MAX_WINDOWS = 60
FORMULAS = {
    "token_hit_ratio": "tokens of the blocks loaded whole from the start of each chain / input tokens",
    "references": "the same requests one after another through an unbounded cache, and LRU and Belady (MIN) "
    "caches of blocks_held blocks; hits are the leading blocks of a chain found",
    "tiers": "g4 = token_hit_ratio x min(1, daemon tier reads over the run / blocks loaded); g3 = the rest of "
    "the hits; miss = 1 - token_hit_ratio",
    "latency": "client side: lookup = one lookup call; load = the get_many_into calls of a request's prefix "
    "(requests with a hit); store = its put_many calls",
    "bytes_written_per_token_served": "bytes of the blocks the replay stored anew / hit tokens",
    "admission": "blocks_not_admitted = the offers (stores) the tenant's admit_after declined (202); "
    "bytes_not_admitted = those x the block size: bytes not written",
    "prefill": "saved_s = hit tokens / prefill_tps (bench/ttft.py's linear prefill) - the loads' measured seconds",
}


@dataclass(slots=True)
class Figures:
    doc: dict[str, Any]  # what --json writes
    notes: list[str] = field(default_factory=list)  # the same list as doc["notes"]


def latency_ms(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """p50, p99 and max in milliseconds (None when nothing was measured), and the count."""
    ms = sorted(v * 1e3 for v in values if v is not None)
    return {
        "p50": percentile_or_none(ms, 0.5),
        "p99": percentile_or_none(ms, 0.99),
        "max": ms[-1] if ms else None,
        "count": len(ms),
    }


def daemon_latency_ms(samples: Sequence[Sample]) -> dict[str, dict[str, float | int | None]]:
    """The daemons' own p50 and p99 of each route of DAEMON_ROUTES over the
    replay (their ``kvstore_http_request_seconds`` histogram, first sample to
    last): the upper bound of the bucket each quantile falls in, so coarse,
    but free of the client's own waits (the replay's client shares the
    machine and its event loop with every request in flight)."""
    out: dict[str, dict[str, float | int | None]] = {}
    if len(samples) < 2:
        return out
    first, last = samples[0].buckets, samples[-1].buckets
    for route, ends in last.items():
        starts = dict(first.get(route, []))
        cumulative = [(le, count - starts.get(le, 0.0)) for le, count in ends]
        total = cumulative[-1][1] if cumulative else 0.0
        out[route] = {"count": int(total)}
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            at = next((le for le, c in cumulative if total and c >= q * total), None)
            out[route][name] = None if at is None or at == float("inf") else at * 1e3
    return out


def _delta(samples: Sequence[Sample], name: str) -> float | None:
    if len(samples) < 2:
        return None
    value: float = getattr(samples[-1], name) - getattr(samples[0], name)
    return value


def tiers(hit_ratio: float, tier_reads: float | None, loaded_blocks: int) -> dict[str, float | None]:
    """{"g3", "g4", "miss"}: the hit ratio split by the share of loaded blocks the
    object tier served (unknown: g3 and g4 None)."""
    miss = 1.0 - hit_ratio
    if tier_reads is None:
        return {"g3": None, "g4": None, "miss": miss}
    g4_share = min(1.0, tier_reads / loaded_blocks) if loaded_blocks else 0.0
    return {"g3": hit_ratio * (1.0 - g4_share), "g4": hit_ratio * g4_share, "miss": miss}


def _ratio(requests: Sequence[Request], hits: Sequence[int] | None, tpb: int) -> float | None:
    return None if hits is None else token_hit_ratio(requests, hits, tpb)


def _prefill(opts: ReplayOptions, hit_tokens: int, load_s: float) -> dict[str, Any] | None:
    """The prefill the hits spared (bench/ttft.py's linear model) less the loads'
    measured time. With scaled-down blocks the loads moved fewer bytes than the
    model's would: no scaling is attempted (small loads cost latency, not
    bandwidth), the note says so."""
    if opts.prefill_tps is None:
        return None
    recompute = recompute_seconds(hit_tokens, opts.prefill_tps)
    return {"prefill_tps": opts.prefill_tps, "recompute_s": recompute, "load_s": load_s, "saved_s": recompute - load_s}


def _window_of(served: Sequence[Served], seconds: float) -> tuple[list[int], int, float]:
    n = min(MAX_WINDOWS, max(1, len(served) // 20))
    width = seconds / n if seconds > 0 else 1.0
    return [min(n - 1, int(s.end_s / width)) for s in served], n, width


def _interp(samples: Sequence[Sample], t: float) -> float:
    """The tier reads counted by ``t`` (linear between samples)."""
    if t <= samples[0].t:
        return samples[0].tier_reads
    for a, b in itertools.pairwise(samples):
        if t <= b.t:
            return a.tier_reads + (b.tier_reads - a.tier_reads) * (t - a.t) / max(b.t - a.t, 1e-9)
    return samples[-1].tier_reads


def timeseries(
    requests: Sequence[Request],
    served: Sequence[Served],
    refs: References,
    samples: Sequence[Sample],
    tpb: int,
    seconds: float,
) -> list[dict[str, Any]]:
    """Per window of the replay (by when requests ended): the hit ratios, the
    tier split and the latencies of the requests that ended in it."""
    where, n, width = _window_of(served, seconds)
    out: list[dict[str, Any]] = []
    for w in range(n):
        idx = [i for i, x in enumerate(where) if x == w]
        reqs = [requests[i] for i in idx]
        point: dict[str, Any] = {"t_s": (w + 1) * width, "requests": len(idx)}
        point["token_hit_ratio"] = _ratio(reqs, [served[i].loaded for i in idx], tpb) if idx else None
        for name in ("unbounded", "lru", "belady"):
            hits: list[int] | None = getattr(refs, name)
            point[f"{name}_token_hit_ratio"] = _ratio(reqs, [hits[i] for i in idx], tpb) if idx and hits else None
        reads = _interp(samples, (w + 1) * width) - _interp(samples, w * width) if len(samples) >= 2 else None
        ratio = point["token_hit_ratio"]
        point["tiers"] = None if ratio is None else tiers(ratio, reads, sum(served[i].loaded for i in idx))
        point["lookup_ms"] = latency_ms([served[i].lookup_s for i in idx])
        point["load_ms"] = latency_ms([served[i].load_s for i in idx])
        out.append(point)
    return out


def _notes(opts: ReplayOptions, done: Replayed, refs: References, scaled: bool) -> list[str]:
    notes: list[str] = []
    if opts.concurrency > 1:
        notes.append(
            f"{opts.concurrency} requests in flight: a request can look up blocks another is still storing, so hits "
            "may fall below the references (which replay one request after another); --concurrency 1 matches them"
        )
    if done.metrics.failure is not None:
        notes.append(f"the G3/G4 split is unknown: {done.metrics.failure} (give --metrics-token)")
    elif opts.existing:
        every = "every member of the fleet" if opts.fleet else "the daemon"
        notes.append(f"the G3/G4 split counts the object-tier reads of every tenant of {every} over the run")
    if opts.fleet:
        notes += _fleet_notes(opts, done)
    if refs.capacity is None:
        notes.append(f"blocks held unknown ({done.held_failure}): no LRU or Belady reference")
    if scaled:
        notes.append(
            f"blocks scaled down to {fmt_bytes(opts.block_bytes)} from {opts.model.name}'s "
            f"{fmt_bytes(opts.model_block_bytes)} per {opts.tokens_per_block} tokens: hit ratios are the same, "
            "bytes, load times and the prefill saved are of the smaller blocks"
        )
    if opts.prefill_tps is None:
        notes.append("no prefill rate: give --prefill-tps for the prefill time the hits save")
    return notes


def _fleet_notes(opts: ReplayOptions, done: Replayed) -> list[str]:
    notes = [
        f"a fleet of {len(done.members)} members: the LRU and Belady references are one cache of blocks_held "
        "blocks, while a fleet's quota is enforced by each node on its own shard (the keys it owns), so the "
        "comparison is approximate (exact while nothing is evicted)"
    ]
    if sorted(done.members_after) != sorted(done.members):
        notes.append(
            f"the fleet's members changed during the replay ({', '.join(done.members)} at the start, "
            f"{', '.join(done.members_after)} at the end): /metrics was summed over those at the start"
        )
    if not opts.existing:
        notes.append(
            "the fleet's bucket is moto's S3 server in this process: its CPU is not in daemon_cpu_s, and it shares "
            "the machine with the nodes"
        )
    return notes


def _fleet(opts: ReplayOptions, done: Replayed) -> dict[str, Any] | None:
    """What the report says of a fleet (None: one daemon)."""
    if not opts.fleet:
        return None
    return {
        "members": len(done.members),
        "started_here": not opts.existing,
        "seeds": list(opts.endpoints) or None,
        "member_urls": done.members,
        "member_urls_at_end": done.members_after,
        "blocks_held_by_member": done.held_by_member,
        "summed_over_members": ["blocks_held", "tiers", "daemon_bytes_written"]
        + ([] if opts.existing else ["daemon_cpu_s"]),
    }


def figures(
    opts: ReplayOptions, requests: Sequence[Request], done: Replayed, refs: References, daemon_cpu_s: float | None
) -> Figures:
    """Every figure of one replay, as the JSON document ``--json`` writes."""
    tpb, served = opts.tokens_per_block, done.served
    cut = shape(requests)
    hit_tokens = sum(r.prefix_tokens(s.loaded, tpb) for r, s in zip(requests, served, strict=True))
    hit_ratio = hit_tokens / cut.tokens if cut.tokens else 0.0
    loaded = sum(s.loaded for s in served)
    stored = sum(s.stored for s in served)
    declined = sum(s.declined for s in served)
    load_s = sum(s.load_s or 0.0 for s in served)
    samples = [] if done.metrics.failure is not None else done.metrics.samples  # a gap: no split, not a wrong one
    written = _delta(samples, "bytes_written")
    scaled = opts.block_bytes != opts.model_block_bytes
    notes = _notes(opts, done, refs, scaled)
    doc: dict[str, Any] = {
        "benchmark": "kvstore-bench replay",
        "token_hit_ratio": hit_ratio,
        "lookup_token_hit_ratio": _ratio(requests, [s.found for s in served], tpb),
        "unbounded_token_hit_ratio": _ratio(requests, refs.unbounded, tpb),
        "lru_token_hit_ratio": _ratio(requests, refs.lru, tpb),
        "belady_token_hit_ratio": _ratio(requests, refs.belady, tpb),
        "tiers": tiers(hit_ratio, _delta(samples, "tier_reads"), loaded),
        "blocks_held": done.blocks_held,
        "fleet": _fleet(opts, done),
        "requests": len(requests),
        "seconds": done.seconds,
        "wrong_bytes": sum(s.wrong_bytes for s in served),
        "errors": done.errors,
        "lookup_ms": latency_ms([s.lookup_s for s in served]),
        "load_ms": latency_ms([s.load_s for s in served]),
        "store_ms": latency_ms([s.store_s for s in served]),
        "daemon_ms": daemon_latency_ms(samples),
        "behind_schedule_ms": latency_ms([s.late_s for s in served]) if opts.speed else None,
        "tokens": cut.tokens,
        "hit_tokens": hit_tokens,
        "blocks_loaded": loaded,
        "blocks_stored": stored,
        "blocks_stored_before": sum(s.stored_before for s in served),
        "blocks_not_admitted": declined,
        "bytes_not_admitted": declined * opts.block_bytes,
        "bytes_loaded": loaded * opts.block_bytes,
        "bytes_stored": stored * opts.block_bytes,
        "bytes_written_per_token_served": stored * opts.block_bytes / hit_tokens if hit_tokens else None,
        "daemon_bytes_written": written,
        "daemon_bytes_written_per_token_served": written / hit_tokens if written is not None and hit_tokens else None,
        "daemon_cpu_s": daemon_cpu_s,
        "daemon_cpu_ms_per_request": daemon_cpu_s * 1e3 / len(requests) if daemon_cpu_s is not None else None,
        "prefill": _prefill(opts, hit_tokens, load_s),
        "workload": _workload(opts, requests),
        "formulas": FORMULAS,
        "notes": notes,
        "timeseries": timeseries(requests, served, refs, samples, tpb, done.seconds),
    }
    return Figures(doc, notes)


def _workload(opts: ReplayOptions, requests: Sequence[Request]) -> dict[str, Any]:
    cut = shape(requests)
    m = opts.model
    return {
        "trace": str(opts.trace),
        "requests": cut.requests,
        "tokens": cut.tokens,
        "blocks": cut.blocks,
        "unique_blocks": cut.unique_blocks,
        "trace_span_s": cut.span_ms / 1e3,
        "model": {"name": m.name, "layers": m.layers, "kv_heads": m.kv_heads, "head_dim": m.head_dim},
        "dtype_bytes": m.dtype_bytes,
        "tokens_per_block": opts.tokens_per_block,
        "block_bytes": opts.block_bytes,
        "model_block_bytes": opts.model_block_bytes,
        "speed": opts.speed or "max",
        "concurrency": opts.concurrency,
        "endpoint": ",".join(opts.endpoints) or None,
        "fleet": opts.fleet,
        "nodes": opts.nodes,
        "policy": None if opts.existing else opts.policy,
        "quota_bytes": opts.quota,
        "admit_after": None if opts.existing else opts.admit_after,
        "settings": opts.settings,
    }


# -- output ------------------------------------------------------------------------------------


def _f(v: float | None, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def _lat(d: dict[str, Any]) -> str:
    return f"{_f(d['p50'], '.2f')} / {_f(d['p99'], '.2f')} / {_f(d['max'], '.2f')}  ({d['count']:,})"


def _size(n: float) -> str:
    return fmt_bytes(n).split(" = ")[-1]


def _rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    t, cap = doc["tiers"], doc["blocks_held"]
    at = f" at {cap:,} blocks" if cap is not None else ""
    rows = [
        ("token hit ratio", f"{_f(doc['token_hit_ratio'])}   g3 {_f(t['g3'])}, g4 {_f(t['g4'])}, miss {_f(t['miss'])}"),
        ("  found by the lookups", _f(doc["lookup_token_hit_ratio"])),
        ("  unbounded cache", _f(doc["unbounded_token_hit_ratio"])),
        (f"  LRU{at}", _f(doc["lru_token_hit_ratio"])),
        (f"  Belady{at}", _f(doc["belady_token_hit_ratio"])),
        ("lookup ms p50 / p99 / max", _lat(doc["lookup_ms"])),
        ("load ms p50 / p99 / max", _lat(doc["load_ms"])),
        ("store ms p50 / p99 / max", _lat(doc["store_ms"])),
    ]
    for route, q in doc["daemon_ms"].items():
        bounds = f"<= {_f(q['p50'], 'g')} / <= {_f(q['p99'], 'g')}  ({q['count']:,})"
        rows.append((f"  daemon's {route} ms p50 / p99", bounds))
    if doc["behind_schedule_ms"] is not None:
        rows.append(("behind the trace, ms", _lat(doc["behind_schedule_ms"])))
    errors = ", ".join(f"{k}: {v}" for k, v in doc["errors"].items()) or "none"
    held = "-" if cap is None else f"{cap:,}"
    by_member = (doc["fleet"] or {}).get("blocks_held_by_member")
    if by_member:
        held += " (" + ", ".join(f"{u.split('://')[-1]}: {n:,}" for u, n in by_member.items()) + ")"
    rows += [
        ("wrong bytes / errors", f"{doc['wrong_bytes']:,} / {errors}"),
        ("blocks held", held),
        ("loaded / stored", f"{_size(doc['bytes_loaded'])} / {_size(doc['bytes_stored'])}"),
    ]
    admit_after = doc["workload"]["admit_after"]
    if doc["blocks_not_admitted"] or admit_after not in (None, 1):
        text = f"{doc['blocks_not_admitted']:,} offers, {_size(doc['bytes_not_admitted'])} not written"
        rows.append(("not admitted" + (f" (admit_after {admit_after})" if admit_after else ""), text))
    written = doc["daemon_bytes_written"]
    rows += [
        ("daemon bytes written", "-" if written is None else _size(written)),
        ("bytes written per token served", _f(doc["bytes_written_per_token_served"], ",.0f")),
    ]
    if doc["daemon_cpu_s"] is not None:
        cpu = f"{doc['daemon_cpu_s']:.2f} s ({doc['daemon_cpu_ms_per_request']:.2f} ms a request)"
        rows.append(("daemon CPU" + (" (all nodes)" if doc["fleet"] else ""), cpu))
    p = doc["prefill"]
    if p is not None:
        text = f"{p['saved_s']:,.2f} s (recompute {p['recompute_s']:,.2f} s - load {p['load_s']:,.2f} s)"
        rows.append(("prefill saved", text))
    return rows


def render(figs: Figures) -> str:
    doc, w = figs.doc, figs.doc["workload"]
    speed = "max" if w["speed"] == "max" else f"{w['speed']:g}x"
    head = [
        f"trace {Path(w['trace']).name}: {w['requests']:,} requests, {w['tokens']:,} input tokens, "
        f"{w['blocks']:,} blocks ({w['unique_blocks']:,} unique) over {w['trace_span_s']:,.1f} s of trace",
        f"blocks of {_size(w['block_bytes'])} ({w['model']['name']}: {_size(w['model_block_bytes'])} per "
        f"{w['tokens_per_block']} tokens); speed {speed}, concurrency {w['concurrency']}; "
        f"replayed in {doc['seconds']:.1f} s ({doc['requests'] / max(doc['seconds'], 1e-9):,.1f} requests/s)",
    ]
    if (fleet := doc["fleet"]) is not None:
        how = "started here" if fleet["started_here"] else f"seeds {', '.join(fleet['seeds'])}"
        head.append(
            f"a fleet of {fleet['members']} members ({how}): blocks held, /metrics counters"
            f"{' and CPU' if fleet['started_here'] else ''} summed over them"
        )
    head.append("")
    rows = _rows(doc)
    width = max(len(k) for k, _ in rows)
    body = [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(head + body + [f"note: {n}" for n in figs.notes])


def compare_table(runs: dict[str, Figures]) -> str:
    """``--compare``: one row per policy, each against the references at the
    blocks its own run held."""
    head = ["policy", "token hit", "LRU ref", "vs LRU", "Belady", "of Belady", "held", "written", "CPU s", "load p99"]
    rows = []
    for policy, figs in runs.items():
        d = figs.doc
        hit, lru, opt = d["token_hit_ratio"], d["lru_token_hit_ratio"], d["belady_token_hit_ratio"]
        written = d["daemon_bytes_written"]
        rows.append(
            [
                policy,
                _f(hit),
                _f(lru),
                f"{hit / lru - 1:+.1%}" if lru else "-",
                _f(opt),
                f"{hit / opt:.1%}" if opt else "-",
                f"{d['blocks_held']:,}" if d["blocks_held"] is not None else "-",
                _size(written) if written is not None else "-",
                _f(d["daemon_cpu_s"], ".1f"),
                _f(d["load_ms"]["p99"], ".1f"),
            ]
        )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(f"{c:<{w}}" for c, w in zip(r, widths, strict=True)).rstrip() for r in [head, *rows])


def write_compared_json(path: Path, runs: dict[str, Figures]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "kvstore-bench replay --compare", "runs": {p: f.doc for p, f in runs.items()}}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def write_json(path: Path, figs: Figures) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figs.doc, indent=1) + "\n")


def write_png(path: Path, figs: Figures) -> None:
    """The hit ratio per window (stacked G3 and G4) against the references, and
    the lookup and load latencies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = figs.doc["timeseries"]
    x = [p["t_s"] for p in ts]

    def series(get: Any) -> list[float]:
        out = []
        for p in ts:
            v = get(p)
            out.append(float("nan") if v is None else float(v))
        return out

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    g3 = series(lambda p: p["tiers"] and (p["tiers"]["g3"] if p["tiers"]["g3"] is not None else p["token_hit_ratio"]))
    g4 = series(lambda p: (p["tiers"] and p["tiers"]["g4"]) or 0.0)
    ax1.stackplot(x, [0.0 if math.isnan(v) else v for v in g3], g4, labels=["hit, G3", "hit, G4"], alpha=0.6)
    for name, style in (("unbounded", "-"), ("lru", "--"), ("belady", ":")):
        ax1.plot(x, series(lambda p, n=name: p[f"{n}_token_hit_ratio"]), style, color="black", label=name)
    w = figs.doc["workload"]
    ax1.set_title(
        f"kvstore-bench replay: {Path(w['trace']).name}, {w['requests']} requests, "
        f"{_size(w['block_bytes'])} blocks, c={w['concurrency']}"
    )
    ax1.set_ylabel("token hit ratio")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize="small")
    ax1.grid(alpha=0.3)
    for key, color in (("lookup_ms", "tab:blue"), ("load_ms", "tab:orange")):
        for q, style in (("p50", "-"), ("p99", "--")):
            ax2.plot(x, series(lambda p, k=key, q=q: p[k][q]), style, color=color, label=f"{key[:-3]} {q}")
    ax2.set_ylabel("latency (ms)")
    ax2.set_xlabel("second of the replay")
    ax2.legend(fontsize="small")
    ax2.grid(alpha=0.3)
    save_png(fig, path)

"""``kvstore-bench replay``'s parts that need no daemon: the trace format, the
reference caches (unbounded, LRU, Belady) on hand-made traces whose answers
are worked out below, the shipped Mooncake trace, the block bytes, the tier
split and the options. The replay against a real daemon is
tests/integration/test_replay.py."""

from __future__ import annotations

import functools
import gzip
import json
import math
import random
import re
import shlex
from pathlib import Path

import pytest
from kvstore_bench import cli
from kvstore_bench.agent_trace import AgentShape, agent_sessions, to_jsonl
from kvstore_bench.policy_sim import POLICIES, Simulation
from kvstore_bench.replay import build_options, build_parser
from kvstore_bench.replay_report import daemon_latency_ms, tiers
from kvstore_bench.replayer import DAEMON_ROUTES, BlockBytes, ReplayOptions, Sample, counter, route_buckets
from kvstore_bench.trace import (
    AGENTS,
    SYNTHETIC,
    Belady,
    Lru,
    Request,
    Unbounded,
    load_trace,
    next_uses,
    parse_request,
    prefix_hits,
    references,
    shape,
    token_hit_ratio,
)

TPB = 10  # tokens per block in the hand-made traces: every chain is whole blocks


def _trace(*chains: list[int]) -> list[Request]:
    return [Request(i, TPB * len(c), 1, tuple(c)) for i, c in enumerate(chains)]


# r0 [1 2 3], r1 [1 2 4], r2 [5 6], r3 [1 2 3], r4 [5 7]: 13 blocks, 130 tokens.
FIVE = _trace([1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3], [5, 7])


def test_unbounded_finds_every_block_stored_before() -> None:
    # r1 finds 1 2 (not 4), r3 all three, r4 finds 5 (not 7).
    assert prefix_hits(FIVE, Unbounded()) == [0, 2, 0, 3, 1]
    assert token_hit_ratio(FIVE, [0, 2, 0, 3, 1], TPB) == pytest.approx(60 / 130)


def test_lru_of_three_blocks() -> None:
    """After r1: [1 2 4] (4 evicted 3); r2 evicts 1 and 2; r3 finds no 1;
    r3 evicts 4 5 6; r4 finds no 5. Only r1's 1 2 are hits."""
    assert prefix_hits(FIVE, Lru(3)) == [0, 2, 0, 0, 0]


def test_belady_of_three_blocks() -> None:
    """MIN keeps 1 2 3 for r3 (4, 5 and 6 are needed later than all three, or
    never): r1 finds 1 2, r3 all three; keeping 5 for r4 would need a fourth
    block, so 50 of 130 tokens is the best three blocks can do."""
    assert prefix_hits(FIVE, Belady(3, next_uses(FIVE))) == [0, 2, 0, 3, 0]
    refs = references(FIVE, 3)
    assert (refs.unbounded, refs.lru, refs.belady) == ([0, 2, 0, 3, 1], [0, 2, 0, 0, 0], [0, 2, 0, 3, 0])


def test_belady_keeps_the_head_of_a_chain() -> None:
    """Two blocks for a chain of three needed again whole: the tail goes (the
    head is a hit, a tail after a lost head would not be); LRU keeps the
    last two used, so the head is lost and nothing is found."""
    twice = _trace([1, 2, 3], [1, 2, 3])
    assert prefix_hits(twice, Belady(2, next_uses(twice))) == [0, 2]
    assert prefix_hits(twice, Lru(2)) == [0, 0]


def test_next_uses_in_access_order() -> None:
    inf = math.inf
    assert next_uses(FIVE) == [3, 4, 10, 8, 9, inf, 11, inf, inf, inf, inf, inf, inf]


@pytest.mark.parametrize("capacity", [0, 1, 7, 100])
def test_references_at_the_ends_of_capacity(capacity: int) -> None:
    """No room: no hit; room for every distinct block (7): as unbounded."""
    refs = references(FIVE, capacity)
    if capacity == 0:
        assert refs.lru == refs.belady == [0] * 5
    if capacity >= 7:
        assert refs.lru == refs.belady == refs.unbounded
    assert refs.lru is not None and refs.belady is not None
    for lru, belady, unbounded in zip(refs.lru, refs.belady, refs.unbounded, strict=True):
        assert lru <= unbounded and belady <= unbounded


def test_no_capacity_no_lru_or_belady() -> None:
    refs = references(FIVE, None)
    assert refs.capacity is None and refs.lru is None and refs.belady is None


def test_a_partial_last_block_counts_its_own_tokens() -> None:
    r = Request(0, 1100, 1, (7, 8, 9))  # 512 + 512 + 76
    assert [r.block_tokens(i, 512) for i in range(3)] == [512, 512, 76]
    assert r.prefix_tokens(3, 512) == 1100 and r.prefix_tokens(2, 512) == 1024


def test_parse_request_names_the_line_and_field() -> None:
    ok = parse_request('{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [4, 9]}', "t:1")
    assert ok == Request(5, 600, 3, (4, 9))
    for line, field in [
        ("{", "not JSON"),
        ("[1]", "expected an object"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": "9", "output_length": 1, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, "2"]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, 1]}', "twice"),
    ]:
        with pytest.raises(ValueError, match=field) as e:
            parse_request(line, "t.jsonl:7")
        assert "t.jsonl:7" in str(e.value)


def test_load_trace_in_time_order_and_cut(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [{"timestamp": t, "input_length": 512, "output_length": 1, "hash_ids": [t]} for t in (30, 10, 20)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert [r.timestamp_ms for r in load_trace(path)] == [10, 20, 30]
    assert [r.hash_ids for r in load_trace(path, 2)] == [(10,), (20,)]
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")


def test_the_shipped_trace_is_mooncakes_synthetic_trace() -> None:
    """3,993 requests, 43,924 distinct blocks, a chain of ceil(input / 512)
    blocks each (data/traces/README.md), shipped beside its attribution."""
    requests = load_trace(SYNTHETIC)
    cut = shape(requests)
    assert (cut.requests, cut.unique_blocks, cut.blocks) == (3993, 43924, 121877)
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in requests)
    readme = (SYNTHETIC.parent / "README.md").read_text()
    assert "Apache" in readme and "kvcache-ai/Mooncake" in readme and "43,924" in readme
    assert token_hit_ratio(requests, references(requests, None).unbounded, 512) == pytest.approx(0.6512, abs=1e-4)


@pytest.mark.parametrize(
    ("name", "requests", "unique"),
    [("synthetic", 3993, 43924), ("conversation", 12031, 182790), ("agents", 1884, 13466)],
)
def test_the_shipped_traces_by_name(name: str, requests: int, unique: int) -> None:
    """``--trace NAME``: the three shipped traces (the gzipped ones read through gzip)."""
    opts = _options("--trace", name)
    cut = shape(load_trace(opts.trace))
    assert (cut.requests, cut.unique_blocks) == (requests, unique)


def test_the_shipped_agent_trace_is_what_the_generator_makes() -> None:
    """agent_sessions.jsonl.gz is ``agent_sessions()`` of the default shape,
    byte for byte: a turn's chain is its session's last chain's full blocks
    and new ones; sessions of one kind share their system prompt's blocks."""
    requests = agent_sessions()
    with gzip.open(AGENTS, "rt", encoding="utf-8") as f:
        assert f.read() == to_jsonl(requests)
    heads = {r.hash_ids[0] for r in requests}
    assert 1 < len(heads) <= AgentShape().kinds  # every session starts with its kind's system prompt
    position: dict[int, int] = {}  # a prefix hash names one place in a chain
    seen: set[int] = set()
    for r in requests:
        assert r.input_length <= AgentShape().max_context and len(r.hash_ids) == -(-r.input_length // 512)
        assert all(position.setdefault(h, i) == i for i, h in enumerate(r.hash_ids))
        if r.input_length % 512:  # a partial last block is never read again
            assert r.hash_ids[-1] not in seen
        seen.update(r.hash_ids)
    reused = sum(len(r.hash_ids) for r in requests) - len(seen)
    assert reused > 10 * len(seen)  # each turn re-reads its session's prefix
    assert agent_sessions(AgentShape(seed=1)) != requests


def test_block_bytes_differ_by_block_and_count_wrong_bytes() -> None:
    pool = bytes(range(256)) * 64  # 16 KiB
    blocks = BlockBytes(5000, pool, nonce=7)
    a, b = blocks.of(1), blocks.of(2)
    assert len(a) == len(b) == 5000 and a != b and blocks.of(1) == a
    assert blocks.wrong(1, memoryview(a)) == 0
    assert blocks.wrong(2, memoryview(a)) > 0  # another block's bytes under this key
    bad = bytearray(a)
    bad[100] ^= 0xFF
    bad[4000] ^= 0x01
    assert blocks.wrong(1, memoryview(bad)) == 2
    assert blocks.wrong(1, memoryview(a)[:4990]) == 10  # short by 10 bytes
    big = BlockBytes(40000, pool, nonce=7)  # larger than the pool: it wraps around
    assert len(big.of(3)) == 40000 and big.wrong(3, memoryview(big.of(3))) == 0


def test_tiers_split_the_hits_by_the_object_tier_reads() -> None:
    assert tiers(0.5, 0.0, 100) == {"g3": 0.5, "g4": 0.0, "miss": 0.5}
    assert tiers(0.5, 25.0, 100) == {"g3": 0.375, "g4": 0.125, "miss": 0.5}
    assert tiers(0.5, 500.0, 100)["g4"] == 0.5  # other tenants' tier reads cannot make it more than the hits
    assert tiers(0.4, None, 100) == {"g3": None, "g4": None, "miss": pytest.approx(0.6)}
    assert tiers(0.0, 3.0, 0) == {"g3": 0.0, "g4": 0.0, "miss": 1.0}


def test_counter_sums_every_label_set() -> None:
    text = (
        "# HELP kvstore_tier_reads_total x\nkvstore_tier_reads_total 4.0\n"
        'kvstore_bytes_written_total{worker="0"} 10\nkvstore_bytes_written_total{worker="1"} 5\n'
        "kvstore_tier_reads_total_other 99\n"
    )
    assert counter(text, "kvstore_tier_reads_total") == 4.0
    assert counter(text, "kvstore_bytes_written_total") == 15.0
    assert counter(text, "kvstore_absent_total") == 0.0


def _options(*argv: str) -> ReplayOptions:
    parser = build_parser()
    return build_options(parser.parse_args(list(argv)), parser.error)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--token", "t"], "--token: only with --endpoint"),
        (["--keep"], "--keep: only with --endpoint"),
        (["--endpoint", "ftp://x", "--token", "t"], "not an http"),
        (["--endpoint", "http://x:1", "--token", "t", "--quota", "1MiB"], "--quota: only for a daemon"),
        (["--set", "novalue"], "NAME=VALUE"),
        (["--speed", "-1"], "--speed"),
        (["--block-bytes", "10"], "at least 64"),
        (["--quota", "12Q"], "argument --quota: '12Q' is not a size"),
        (["--requests", "0"], "--requests"),
        (["--admit-after", "0"], "argument --admit-after: 0 must be 1 to 16"),
        (["--admit-after", "two"], "argument --admit-after: 'two' is not an integer"),
        (["--endpoint", "http://x:1", "--token", "t", "--admit-after", "2"], "--admit-after: only for a daemon"),
        (["--trace", "/nonexistent.jsonl"], "not a file"),
        (["--compare", "lru,lfu", "--quota", "1MiB"], "argument --compare: 'lru,lfu': expected policies among"),
        (["--compare", "lru,probation"], "--compare: needs --quota"),
        (["--compare", "lru", "--quota", "1MiB", "--set", "quota_eviction=lru"], "drop --set quota_eviction"),
        (["--compare", "lru", "--endpoint", "http://x:1", "--token", "t"], "--compare: only for one daemon"),
    ],
)
def test_bad_options_exit_2_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    with pytest.raises(SystemExit) as e:
        _options(*argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_options_scale_the_blocks_and_read_the_speed() -> None:
    opts = _options("--block-bytes", "16KiB", "--speed", "max", "--quota", "8MiB", "--set", "frame_size=64KiB")
    assert opts.block_bytes == 16384 and opts.speed == 0.0
    assert opts.model_block_bytes == 512 * 131072  # Llama-3.1-8B, 512 tokens
    assert opts.settings == {"frame_size": "64KiB"} and opts.quota == 8 << 20
    assert _options("--speed", "2.5").speed == 2.5
    assert _options("--speed", "0.0").speed == _options("--speed", "MAX").speed == 0.0
    assert _options("--model", "layers=2,kv_heads=1,head_dim=8").block_bytes == 2 * 2 * 8 * 2 * 512
    assert _options().admit_after == 1 and _options("--admit-after", "3").admit_after == 3


def test_replay_is_a_subcommand_with_its_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert "replay" in cli.COMMANDS
    with pytest.raises(SystemExit) as e:
        cli.main(["replay", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--trace", "--endpoint", "--token", "--requests", "--block-bytes", "--speed", "--concurrency"):
        assert flag in out
    assert "--json" in out and "--png" in out


def _best_prefix_hits(requests: list[Request], capacity: int) -> int:
    """The most prefix blocks any cache of ``capacity`` blocks finds: every
    choice (keep a new block or not, and which block it evicts), searched."""
    flat = [h for r in requests for h in r.hash_ids]
    starts: dict[int, Request] = {}
    position = 0
    for r in requests:
        starts[position] = r
        position += len(r.hash_ids)

    @functools.cache
    def best(p: int, held: frozenset[int]) -> int:
        if p == len(flat):
            return 0
        found = 0
        if p in starts:
            found = next((i for i, h in enumerate(starts[p].hash_ids) if h not in held), len(starts[p].hash_ids))
        h = flat[p]
        if h in held:
            return found + best(p + 1, held)
        options = [held] if len(held) >= capacity else [held, held | {h}]
        if len(held) >= capacity:
            options += [(held - {v}) | {h} for v in held]
        return found + max(best(p + 1, o) for o in options)

    return best(0, frozenset())


def _random_prefix_trace(rng: random.Random) -> list[Request]:
    """Requests whose ids are prefix hashes, as a trace's are: an id stands for
    its whole prefix (paths from the root of a tree of blocks, two children a
    block)."""
    ids: dict[tuple[int, ...], int] = {}
    requests = []
    for i in range(rng.randint(3, 7)):
        path: tuple[int, ...] = ()
        chain = []
        for _ in range(rng.randint(1, 4)):
            path += (rng.randint(0, 1),)
            chain.append(ids.setdefault(path, len(ids)))
        requests.append(Request(i, len(chain), 1, tuple(chain)))
    return requests


def test_belady_finds_as_much_as_an_exhaustive_search() -> None:
    """On small random traces of prefix hashes, the Belady reference finds as
    many prefix blocks as the best choice of evictions (MIN is proven optimal
    for single-block hits, not for prefixes: checked here), and LRU never finds
    more."""
    rng = random.Random(41)
    for _ in range(200):
        requests = _random_prefix_trace(rng)
        capacity = rng.randint(1, 4)
        refs = references(requests, capacity)
        assert refs.belady is not None and refs.lru is not None
        assert sum(refs.belady) == _best_prefix_hits(requests, capacity), (capacity, requests)
        assert sum(refs.lru) <= sum(refs.belady)


def test_the_readme_examples_parse() -> None:
    readme = Path(__file__).resolve().parents[2] / "bench" / "README.md"
    lines = re.findall(r"^(?:KVSTORE_TOKEN=\S+ )?\.venv/bin/kvstore-bench replay (.*)$", readme.read_text(), re.M)
    assert len(lines) >= 4, lines
    for line in lines:
        build_parser().parse_args(shlex.split(line))


def test_a_trace_of_token_ids_is_chained_as_engines_hash_prefixes(tmp_path: Path) -> None:
    """Blocks of 4 tokens: a block's id stands for its whole prefix, the
    partial tail has none, and equal tokens after another prefix are
    another block."""
    lines = [
        {"timestamp": 3, "token_ids": list(range(1, 11)), "output_length": 7},  # 2 full blocks + 2 tokens
        {"timestamp": 5, "input_ids": [*range(1, 9), 99, 98, 97, 96]},  # the same 2, then its own
        {"token_ids": [1, 2, 3, 4, 7, 7, 7, 7]},  # no timestamp: 0, first in time
        {"timestamp": 9, "token_ids": [5, 5, 5, 5, 1, 2, 3, 4]},  # 1..4 again, after another prefix
    ]
    path = tmp_path / "tokens.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    r3, r1, r2, r4 = load_trace(path, tokens_per_block=4)
    assert (r1.input_length, r1.output_length, r3.timestamp_ms, r3.output_length) == (10, 7, 0, 0)
    a, b = r1.hash_ids
    assert r2.hash_ids[:2] == (a, b) and len(r2.hash_ids) == 3 and r2.hash_ids[2] not in (a, b)
    assert r3.hash_ids[0] == a and r3.hash_ids[1] not in (a, b)
    assert len(set(r4.hash_ids) & {a, b}) == 0
    # Every reusable full block is a hit; the tail tokens never are.
    assert prefix_hits([r1, r2], Unbounded()) == [0, 2]
    assert r2.prefix_tokens(2, 4) == 8


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"token_ids": [1, True, 3]}, "token_ids must be a list of integers"),
        ({"input_ids": "1 2 3"}, "input_ids must be a list of integers"),
        ({"token_ids": [1, 2, 3], "input_length": 4}, "input_length 4 is not the 3 token_ids"),
        ({"timestamp": -1, "token_ids": [1]}, "timestamp must be an integer"),
    ],
)
def test_a_bad_token_line_names_its_field(tmp_path: Path, doc: dict[str, object], says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(doc) + "\n")
    with pytest.raises(ValueError, match=says):
        load_trace(path, tokens_per_block=4)


def test_the_daemons_own_latency_comes_from_its_histogram_over_the_run() -> None:
    """Its request-time buckets, first sample to last, every method summed:
    each quantile is the upper bound of the bucket it falls in."""

    def text(counts: dict[str, int]) -> str:
        return "".join(
            f'kvstore_http_request_seconds_bucket{{method="{m}",route="/v1/lookup",le="{le}"}} {counts[le] // 2}\n'
            for le in counts
            for m in ("GET", "POST")
        )

    before = route_buckets(text({"0.001": 10, "0.005": 10, "+Inf": 10}), DAEMON_ROUTES)
    after = route_buckets(text({"0.001": 108, "0.005": 208, "+Inf": 212}), DAEMON_ROUTES)
    assert after == {"lookup": [(0.001, 108.0), (0.005, 208.0), (float("inf"), 212.0)]}
    got = daemon_latency_ms([Sample(0.0, 0, 0, before), Sample(1.0, 0, 0, after)])
    # 98 of 202 within 1 ms, 198 within 5 ms: the p99 is past the last bound (none said)
    assert got == {"lookup": {"count": 202, "p50": 5.0, "p99": None}}


def test_the_policy_simulation_runs_the_daemons_choice_functions() -> None:
    """policy_sim: with room for every block each policy finds what an
    unbounded cache finds; lru matches the LRU reference on a trace without
    ties; leaf-first never leaves a block whose prefix is gone."""
    requests = load_trace(SYNTHETIC, 400)
    unique = shape(requests).unique_blocks
    unbounded = references(requests, None).unbounded
    for policy in POLICIES:
        assert Simulation(unique, policy, "flat").run(requests) == unbounded
    rng = random.Random(3)
    single = [Request(i, 512, 1, (int(rng.paretovariate(1.2)) % 150,)) for i in range(2000)]  # no ties
    assert Simulation(100, "lru", "flat").run(single) == references(single, 100).lru  # (99%: one a time)
    assert sum(references(single, 100).lru or []) > 200
    leaf = Simulation(shape(requests).unique_blocks // 10, "lru-leaf", "flat")
    leaf.run(requests)
    assert all(b.parent is None or b.parent in leaf.held for b in leaf.held.values())

"""kvstore_bench.models, .sizing, .ttft and .cli: KV-cache sizing and the load-vs-recompute model."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from kvstore_bench import cli
from kvstore_bench.models import PRESETS, ModelGeometry, get_preset, parse_custom, preset_names, resolve_model
from kvstore_bench.sizing import (
    GB,
    PB,
    GiB,
    capacity_bytes,
    fmt_binary,
    fmt_bytes,
    fmt_decimal,
    kv_bytes_per_block,
    kv_bytes_per_session,
    kv_bytes_per_token,
    tp_shard,
)
from kvstore_bench.ttft import break_even, load_seconds, recompute_seconds, ttft_row

L405 = get_preset("Llama-3.1-405B")

# -- the check values


def test_llama_405b_fp16_is_516096_bytes_per_token() -> None:
    assert kv_bytes_per_token(L405) == 126 * 2 * 8 * 128 * 2 == 516_096


def test_llama_405b_127188_token_session_is_61_gib() -> None:
    n = kv_bytes_per_session(L405, 127_188)
    assert n == 516_096 * 127_188 == 65_641_218_048
    assert round(n / GB, 2) == 65.64  # decimal GB
    assert round(n / GiB, 2) == 61.13  # the "~61 GB" is GiB
    assert fmt_bytes(n) == "65,641,218,048 B = 65.64 GB = 61.13 GiB"


def test_capacity_100k_users_30gb_retention_15_is_45_pb() -> None:
    total = capacity_bytes(100_000, 30 * GB, 15)
    assert total == 45 * PB == 4.5e16
    assert fmt_decimal(total) == "45.00 PB"
    assert fmt_binary(total) == "39.97 PiB"


# -- presets


@pytest.mark.parametrize(
    ("name", "per_token"),
    [
        ("Llama-3.1-8B", 32 * 2 * 8 * 128 * 2),  # 131,072
        ("Llama-3.1-70B", 80 * 2 * 8 * 128 * 2),  # 327,680
        ("Llama-3.1-405B", 516_096),
        ("Qwen2.5-7B", 28 * 2 * 4 * 128 * 2),  # 57,344
        ("Qwen2.5-72B", 80 * 2 * 8 * 128 * 2),
        ("Mixtral-8x7B", 32 * 2 * 8 * 128 * 2),
    ],
)
def test_preset_bytes_per_token(name: str, per_token: int) -> None:
    assert kv_bytes_per_token(get_preset(name)) == per_token


def test_preset_lookup_is_case_insensitive() -> None:
    assert get_preset("llama-3.1-405b") is L405
    assert get_preset("  QWEN2.5-7B ") is get_preset("Qwen2.5-7B")
    assert resolve_model("mixtral-8x7b").name == "Mixtral-8x7B"
    assert len(preset_names()) == len(PRESETS) >= 6


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'llama-4'") as e:
        get_preset("llama-4")
    for name in preset_names():
        assert name in str(e.value)


def test_no_preset_invents_a_prefill_rate() -> None:
    assert all(m.prefill_tokens_per_s_8gpu is None for m in PRESETS)


def test_custom_geometry() -> None:
    m = parse_custom("layers=126,kv_heads=8,head_dim=128,dtype=fp16")
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype_bytes) == (126, 8, 128, 2)
    assert kv_bytes_per_token(m) == 516_096
    assert kv_bytes_per_token(parse_custom("custom:layers=126, kv_heads=8, head_dim=128, dtype=FP8")) == 258_048
    assert kv_bytes_per_token(resolve_model("layers=126,kv_heads=8,head_dim=128,dtype=fp32")) == 1_032_192
    assert parse_custom("layers=1,kv_heads=1,head_dim=1").dtype_bytes == 2  # fp16 by default
    assert kv_bytes_per_token(L405.with_dtype("fp8")) == 258_048


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("layers=32,kv_heads=8", "missing head_dim"),
        ("layers=32,kv_heads=8,head_dim=128,experts=8", "unknown key 'experts'"),
        ("layers=x,kv_heads=8,head_dim=128", "layers='x' is not an integer"),
        ("layers=0,kv_heads=8,head_dim=128", "layers=0 must be at least 1"),
        ("layers=32,kv_heads=8,head_dim=128,dtype=int4", "unknown dtype 'int4'"),
        ("layers=32,layers=8,kv_heads=8,head_dim=128", "layers given twice"),
        ("layers=32,kv_heads,head_dim=128", "'kv_heads' is not key=value"),
    ],
)
def test_custom_geometry_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_custom(spec)


def test_geometry_rejects_non_positive_fields() -> None:
    with pytest.raises(ValueError, match="kv_heads must be a positive integer"):
        ModelGeometry("bad", layers=1, kv_heads=0, head_dim=1)


# -- per block, per TP rank


def test_per_block() -> None:
    assert kv_bytes_per_block(L405, 16) == 516_096 * 16 == 8_257_536
    assert kv_bytes_per_block(L405, 256) == 132_120_576  # 126 MiB
    with pytest.raises(ValueError, match="tokens per block"):
        kv_bytes_per_block(L405, 0)


@pytest.mark.parametrize(
    ("tp", "heads", "replication", "per_rank"),
    [
        (1, 8, 1, 516_096),
        (2, 4, 1, 258_048),
        (4, 2, 1, 129_024),
        (8, 1, 1, 64_512),
        (16, 1, 2, 64_512),  # more ranks than KV heads: each head on 2 ranks
        (32, 1, 4, 64_512),
    ],
)
def test_tp_shard(tp: int, heads: int, replication: int, per_rank: int) -> None:
    s = tp_shard(L405, tp)
    assert (s.kv_heads_per_rank, s.replication, s.bytes_per_token_per_rank) == (heads, replication, per_rank)
    assert s.bytes_per_token_all_ranks == tp * per_rank == replication * 516_096


@pytest.mark.parametrize(("tp", "message"), [(3, "does not divide"), (12, "not a multiple"), (0, "at least 1")])
def test_tp_shard_errors(tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tp_shard(L405, tp)


def test_capacity_errors() -> None:
    with pytest.raises(ValueError, match="retention"):
        capacity_bytes(1, 1.0, 0)
    with pytest.raises(ValueError, match="users"):
        capacity_bytes(-1, 1.0, 1)


def test_formatting() -> None:
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(516_096) == "516,096 B = 516.10 kB = 504.00 KiB"
    assert fmt_decimal(1e9) == "1.00 GB" and fmt_binary(2**30) == "1.00 GiB"


# -- TTFT model


def test_load_and_recompute_times() -> None:
    # 1,000 tokens x 1 MB at 2 GB/s = 0.5 s, + 10 ms; 1,000 tokens at 4,000 tokens/s = 0.25 s
    assert load_seconds(1000, 1_000_000, 2.0, 0.010) == pytest.approx(0.51)
    assert recompute_seconds(1000, 4000) == pytest.approx(0.25)
    row = ttft_row(1000, 1_000_000, 2.0, 4000, 0.010)
    assert row.kv_bytes == 1_000_000_000
    assert row.speedup == pytest.approx(0.25 / 0.51)
    assert row.winner == "recompute"


def test_break_even_above() -> None:
    # load 1 us/token (1 kB at 1 GB/s), compute 100 us/token: d = 99 us; 9.9 ms latency -> N* = 100 tokens
    be = break_even(1000, 1.0, 10_000, 0.0099)
    assert be.verdict == "above"
    assert be.tokens == pytest.approx(100)
    assert be.saved_s_per_token == pytest.approx(99e-6)
    assert be.describe() == "loading wins above 100 tokens"
    # at N*, both take the same time; above it loading wins, below it recomputing does
    assert load_seconds(100, 1000, 1.0, 0.0099) == pytest.approx(recompute_seconds(100, 10_000))
    assert ttft_row(101, 1000, 1.0, 10_000, 0.0099).winner == "load"
    assert ttft_row(99, 1000, 1.0, 10_000, 0.0099).winner == "recompute"


def test_break_even_llama_70b() -> None:
    # 327,680 B/token at 10 GB/s = 32.768 us; 20,000 tokens/s = 50 us; 5 ms / 17.232 us = 290.16 tokens
    be = break_even(327_680, 10.0, 20_000, 0.005)
    assert be.tokens == pytest.approx(0.005 / (50e-6 - 32.768e-6))
    assert round(be.tokens or 0, 2) == 290.16


def test_break_even_always_and_never() -> None:
    always = break_even(1000, 1.0, 10_000, 0.0)
    assert (always.verdict, always.tokens) == ("always", 0.0)
    assert "always" in always.describe()
    # 1 MB/token at 1 GB/s = 1 ms/token, slower than 0.1 ms/token compute
    never = break_even(1_000_000, 1.0, 10_000, 0.005)
    assert (never.verdict, never.tokens) == ("never", None)
    assert never.saved_s_per_token == pytest.approx(-0.9e-3)
    # exactly equal per-token costs: loading never gets ahead, with or without latency
    assert break_even(100_000, 1.0, 10_000, 0.0).verdict == "never"
    assert break_even(100_000, 1.0, 10_000, 0.001).verdict == "never"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"throughput_gbps": 0.0}, "throughput"),
        ({"prefill_tps": -1.0}, "prefill rate"),
        ({"latency_s": -0.001}, "latency"),
        ({"throughput_gbps": math.nan}, "throughput"),
    ],
)
def test_break_even_rejects_bad_input(kwargs: dict[str, float], message: str) -> None:
    args: dict[str, Any] = {"bytes_per_token": 1000, "throughput_gbps": 1.0, "prefill_tps": 1000.0, "latency_s": 0.0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        break_even(**args)


# -- CLI end to end


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> Any:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_size_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["size", "--model", "llama-3.1-405b", "--context", "127188", "--tp", "16"])
    assert out["model"]["name"] == "Llama-3.1-405B"
    assert out["bytes_per_token"] == 516_096
    assert out["tokens_per_block"] == 256 and out["bytes_per_block"] == 516_096 * 256
    assert out["tp"] == {
        "size": 16,
        "kv_heads_per_rank": 1,
        "replication": 2,
        "bytes_per_token_per_rank": 64_512,
        "bytes_per_block_per_rank": 64_512 * 256,
        "bytes_per_token_all_ranks": 1_032_192,
    }
    assert out["session"]["bytes"] == 65_641_218_048
    assert round(out["session"]["gib"], 2) == 61.13
    assert out["session"]["blocks"] == 497  # ceil(127188 / 256)
    assert out["capacity"] is None


def test_cli_size_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["size", "--model", "Llama-3.1-405B", "--users", "100000", "--per-user-gb", "30", "--retention", "15"]
    out = run_json(capsys, argv)
    assert out["capacity"]["bytes"] == 4.5e16
    assert out["capacity"]["pb"] == pytest.approx(45.0)
    # without --per-user-gb, one user is one --context session
    out = run_json(capsys, ["size", "--model", "llama-3.1-405b", "--context", "127188", "--users", "2"])
    assert out["capacity"]["bytes"] == 2 * 65_641_218_048


def test_cli_size_custom_and_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys, ["size", "--model", "layers=126,kv_heads=8,head_dim=128,dtype=bf16", "--tokens-per-block", "16"]
    )
    assert out["bytes_per_token"] == 516_096 and out["bytes_per_block"] == 8_257_536
    out = run_json(capsys, ["size", "--model", "llama-3.1-405b", "--dtype", "fp8"])
    assert out["bytes_per_token"] == 258_048


def test_cli_size_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["size", "--model", "llama-3.1-405b", "--context", "127188"]) == 0
    text = capsys.readouterr().out
    assert "516,096 B" in text
    assert "65,641,218,048 B = 65.64 GB = 61.13 GiB" in text


def test_cli_ttft_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["ttft", "--model", "llama-3.1-70b", "--throughput-gbps", "10", "--prefill-tps", "20000"]
    out = run_json(capsys, [*argv, "--latency-ms", "5", "--tokens", "100", "1000"])
    assert out["bytes_per_token"] == 327_680
    small, large = out["rows"]
    assert small["tokens"] == 100 and small["winner"] == "recompute"  # below N* = 290
    assert large["load_s"] == pytest.approx(0.005 + 1000 * 327_680 / 10e9)
    assert large["recompute_s"] == pytest.approx(0.05)
    assert large["winner"] == "load" and large["speedup"] > 1
    assert out["break_even"]["verdict"] == "above"
    assert out["break_even"]["tokens"] == pytest.approx(290.16, abs=0.01)


def test_cli_ttft_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["ttft", "--model", "qwen2.5-7b", "--throughput-gbps", "0.5", "--prefill-tps", "1000"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "break-even: loading always wins" in text
    assert "131,072" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["size", "--model", "gpt-5"], "argument --model: unknown model 'gpt-5'"),
        (["size", "--model", "layers=1,kv_heads=1"], "argument --model: custom geometry: missing head_dim"),
        (["size", "--model", "llama-3.1-8b", "--tp", "3"], "argument --tp: tensor-parallel size 3 does not divide"),
        (["size", "--model", "llama-3.1-8b", "--tp", "0"], "argument --tp: 0 must be at least 1"),
        (["size", "--model", "llama-3.1-8b", "--context", "-5"], "argument --context: -5 must be at least 0"),
        (["size", "--model", "llama-3.1-8b", "--tokens-per-block", "x"], "argument --tokens-per-block: 'x' is not"),
        (["size", "--model", "llama-3.1-8b", "--users", "10"], "argument --users: needs --per-user-gb"),
        (["size", "--model", "llama-3.1-8b", "--retention", "15"], "argument --retention: only used with --users"),
        (
            ["size", "--model", "llama-3.1-8b", "--users", "1", "--per-user-gb", "nan"],
            "argument --per-user-gb: 'nan' must be finite",
        ),
        (["size", "--model", "llama-3.1-8b", "--dtype", "int4"], "argument --dtype: unknown dtype 'int4'"),
        (
            ["ttft", "--model", "llama-3.1-8b", "--throughput-gbps", "10"],
            "argument --prefill-tps: required: Llama-3.1-8B has no preset prefill rate",
        ),
        (
            ["ttft", "--model", "llama-3.1-8b", "--throughput-gbps", "0", "--prefill-tps", "1"],
            "argument --throughput-gbps: 0 must be positive",
        ),
        (
            ["ttft", "--model", "llama-3.1-8b", "--throughput-gbps", "1", "--prefill-tps", "1", "--latency-ms", "-1"],
            "argument --latency-ms: -1 must be at least 0",
        ),
        (
            ["ttft", "--model", "llama-3.1-8b", "--throughput-gbps", "1", "--prefill-tps", "1", "--tokens", "0"],
            "argument --tokens: 0 must be at least 1",
        ),
        (["ttft", "--model", "llama-3.1-8b"], "the following arguments are required: --throughput-gbps"),
    ],
)
def test_cli_bad_input_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err

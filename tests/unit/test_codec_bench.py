"""kvstore-bench codec on a slice of a real KV cache: every compression and
both policies round-trip (the bench checks the bytes), and the ratios are
those the store gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvstore_bench.cli import main

from tests.conftest import KV_DIR


def test_codec_bench_measures_every_compression(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    samples = tmp_path / "samples"
    samples.mkdir()
    (samples / "gemma.bf16.bin").write_bytes((KV_DIR / "gemma3-270m.bf16.layers8-9.bin").read_bytes()[: 512 << 10])
    out = tmp_path / "codec.json"
    args = ["codec", "--samples", str(samples), "--frame-sizes", "64KiB,256KiB", "--repeats", "1", "--json", str(out)]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    codecs = {(r["compression"], r["sealed"], r["frame_size"]): r for r in rows if "compression" in r}
    assert len(codecs) == 3 * 2 * 2
    for (comp, sealed, _), r in codecs.items():
        assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0 and r["client_decode_gbps"] > 0
        if comp == "none":  # sealed: each frame carries its 16-byte GCM tag
            assert r["ratio"] == 1.0 if not sealed else 0.999 < r["ratio"] < 1.0
    # Real bf16 KV: the byte-plane split beats plain zstd, which beats nothing.
    for fs in (64 << 10, 256 << 10):
        assert codecs[("zstd-bp2", True, fs)]["ratio"] > codecs[("zstd", True, fs)]["ratio"] > 1.1
    assert [r for r in rows if "checksum_gbps" in r]
    assert "zstd-bp2" in capsys.readouterr().out


def test_codec_bench_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["codec", "--samples", str(tmp_path)])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["codec", "--frame-sizes", "lots"])

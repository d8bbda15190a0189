"""Key helpers (test vectors, stable across processes) and the batch framing."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest
from kvstore_client import block_keys, model_fingerprint, rank_endpoints
from kvstore_client.errors import InvalidKeyError
from kvstore_client.keys import check_key

FP = "cb6557cd55954638b164799b4bf9c64c"
VECTORS = {
    "fp": FP,
    "keys_0_9_bs4": ["38043a16be460428ab016d0c479d98aa", "1aa40ac97a401e37072885002a937c43"],
    "keys_fp_1_8_bs4": ["afb70b589207a8f9588a004bc50e3c0c", "3aacc3f320e877b6ad52077587206d3d"],
}

SCRIPT = """
import json
from kvstore_client import block_keys, model_fingerprint, rank_endpoints
fp = model_fingerprint("meta-llama/Llama-3.1-8B@main", "bfloat16", "vllm-paged-v1", 0, 2)
print(json.dumps({
    "fp": fp,
    "keys_0_9_bs4": block_keys(fp, list(range(10)), 4),
    "keys_fp_1_8_bs4": block_keys("fp", [1, 2, 3, 4, 5, 6, 7, 8], 4),
    "rank": rank_endpoints(["http://a:1", "http://b:2", "http://c:3"], "k1"),
}))
"""


def test_vectors() -> None:
    assert model_fingerprint("meta-llama/Llama-3.1-8B@main", "bfloat16", "vllm-paged-v1", 0, 2) == FP
    assert block_keys(FP, list(range(10)), 4) == VECTORS["keys_0_9_bs4"]
    assert block_keys("fp", [1, 2, 3, 4, 5, 6, 7, 8], 4) == VECTORS["keys_fp_1_8_bs4"]


def test_spec() -> None:
    """The documented construction, written out independently."""

    def lp(b: bytes) -> bytes:
        return struct.pack("<I", len(b)) + b

    parent = b""
    expected = []
    for block in ([1, 2, 3, 4], [5, 6, 7, 8]):
        h = hashlib.blake2b(b"kvstore-key-v1", digest_size=16)
        h.update(lp(b"fp") + lp(parent) + struct.pack("<I", 4) + struct.pack("<4I", *block))
        expected.append(h.hexdigest())
        parent = expected[-1].encode()
    assert block_keys("fp", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == expected


def test_properties() -> None:
    keys = block_keys(FP, list(range(100)), 16)
    assert len(keys) == 6  # only full blocks
    assert all(check_key(k) == k and len(k) == 32 for k in keys)
    assert block_keys(FP, list(range(64)), 16) == keys[:4]  # a prefix of tokens -> a prefix of keys
    assert block_keys(FP, [0, *list(range(1, 100))], 16) == keys
    changed = block_keys(FP, [999, *list(range(1, 100))], 16)
    assert all(a != b for a, b in zip(changed, keys, strict=True))  # chained: the first block changes all
    assert block_keys(model_fingerprint("m", "bf16", "l", 1, 2), list(range(32)), 16) != block_keys(
        model_fingerprint("m", "bf16", "l", 0, 2), list(range(32)), 16
    )
    assert block_keys(FP, [], 16) == []
    with pytest.raises(ValueError):
        block_keys(FP, [-1, 2], 2)
    with pytest.raises(ValueError):
        model_fingerprint("m", "bf16", "l", 2, 2)


def test_numpy_tokens() -> None:
    np = pytest.importorskip("numpy")
    assert block_keys(FP, np.arange(10, dtype=np.int64), 4) == VECTORS["keys_0_9_bs4"]


def test_stable_across_processes() -> None:
    outs = []
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, check=True, text=True)
        outs.append(json.loads(out.stdout))
    assert outs[0] == outs[1]
    assert {k: outs[0][k] for k in VECTORS} == VECTORS
    assert outs[0]["rank"] == rank_endpoints(["http://a:1", "http://b:2", "http://c:3"], "k1")


def test_check_key_before_sending() -> None:
    assert check_key("k.1:a=b+c~d@e-f_g") == "k.1:a=b+c~d@e-f_g"
    with pytest.raises(InvalidKeyError, match="key contains '/' at position 1"):
        check_key("a/b")


def test_no_server_package_imported() -> None:
    """The client, its wire module included, stands alone: the daemon imports
    the wire module, never the reverse (the frame codecs need the decode
    extra: zstandard, numpy)."""
    code = (
        "import sys, kvstore_client, kvstore_client.wire.batchframe, kvstore_client.wire.keys, "
        "kvstore_client.wire.nixl_loader; "
        "print([m for m in sys.modules if m.split('.')[0] in ('kvstore', 'lmdb', 'zstandard', 'numpy')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True)
    assert out.stdout.strip() == "[]"
    code = (
        "import sys, kvstore_client.wire.codec, kvstore_client.record; "
        "print([m for m in sys.modules if m.split('.')[0] == 'kvstore'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True)
    assert out.stdout.strip() == "[]"

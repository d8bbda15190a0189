"""Keys: the check before sending, and content addresses for token blocks.

:func:`check_key` applies the key grammar the daemon applies
(kvstore_client/wire/keys.py) before a key is sent.

A block's key depends on the model fingerprint, on every token before it and
on its own tokens, so a prefix of a prompt maps to a prefix of the key list
(which is what :meth:`AsyncClient.lookup` measures). Keys are stable across
processes, machines and Python versions (no ``hash()``): see the test vectors
in clients/README.md.

Hashes are BLAKE2b with a 16-byte digest; fields are length-prefixed so that
no two different inputs share an encoding::

    key_i = hex(blake2b-128(b"kvstore-key-v1"
                            || u32le(len(fp)) || fp
                            || u32le(len(parent)) || parent          # key_{i-1}, or empty for i = 0
                            || u32le(block_size) || tokens_i as u32le each))

    fingerprint = hex(blake2b-128(b"kvstore-fp-v1" || for each field: u32le(len) || utf-8 field))
                  fields: model, dtype, layout, str(tp_rank), str(tp_size), extra

Keys are 32 lowercase hex digits: inside the server's key grammar
``[A-Za-z0-9._~:@=+-]{1,256}``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvstore_client.errors import InvalidKeyError
from kvstore_client.wire.keys import key_problem

KEY_DOMAIN = b"kvstore-key-v1"
FINGERPRINT_DOMAIN = b"kvstore-fp-v1"
_U32 = struct.Struct("<I")
_U32_MAX = (1 << 32) - 1


def check_key(key: str) -> str:
    """``key`` if it matches the daemon's key grammar, else InvalidKeyError."""
    problem = key_problem(key)
    if problem is None:
        return key
    raise InvalidKeyError(f"invalid key {key!r}: {problem}")


def _lp(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def model_fingerprint(model: str, dtype: str, layout: str, tp_rank: int, tp_size: int, extra: str = "") -> str:
    """A 32-hex-digit digest of everything that makes KV bytes incompatible:
    the model (name and revision), the KV dtype, the memory layout, the tensor
    parallel rank and size, and anything else (``extra``, e.g. a quantization
    recipe or the engine's KV format version)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be 0 <= tp_rank < tp_size, got {tp_rank}, {tp_size}")
    h = hashlib.blake2b(FINGERPRINT_DOMAIN, digest_size=16)
    for f in (model, dtype, layout, str(tp_rank), str(tp_size), extra):
        h.update(_lp(f.encode("utf-8")))
    return h.hexdigest()


def block_keys(fingerprint: str, token_ids: Sequence[int], block_size: int) -> list[str]:
    """The keys of the full blocks of ``token_ids`` (a partial last block has no key).

    ``token_ids`` may be any sequence of ints (list, tuple, array, a 1-D
    numpy array); each must be 0 to 2**32-1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    fp = _lp(fingerprint.encode("utf-8"))
    size = _U32.pack(block_size)
    fmt = struct.Struct(f"<{block_size}I")
    keys: list[str] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = [int(t) for t in token_ids[start : start + block_size]]
        try:
            packed = fmt.pack(*block)
        except struct.error:
            bad = next(t for t in block if not 0 <= t <= _U32_MAX)
            raise ValueError(f"token id {bad} at block {len(keys)} is outside 0 to 2**32-1") from None
        h = hashlib.blake2b(KEY_DOMAIN, digest_size=16)
        h.update(fp)
        h.update(_lp(parent))
        h.update(size)
        h.update(packed)
        key = h.hexdigest()
        keys.append(key)
        parent = key.encode("ascii")
    return keys

"""One residency event, and the engine's identity of a block.

An event is one change to what the store holds, for one tenant:

- ``stored``: blocks written (tier ``local``), or present in a tier they
  were not in before (``object`` when the local copy is dropped and the
  object tier keeps them, ``local`` when a segment is rehydrated);
- ``removed``: blocks gone from a tier (``cause``: ``deleted``, ``expired``,
  ``quota``, ``evicted`` under disk pressure, ``moved`` when only the local
  copy went);
- ``cleared``: every block of the tenant gone (the tenant was deleted).

``seq`` numbers the node's events from 0 without gaps, in the order they
happened (per daemon run: a restart starts again at 0 with a new ``epoch``).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import xxhash

from kvstore import jsonlimits
from kvstore.errors import InvalidInput

Kind = Literal["stored", "removed", "cleared"]
TierName = Literal["local", "object"]
META_HEADER = "Kvstore-Block-Meta"
META_MAX = 64 << 10  # bytes of the header's JSON
EXTRA_KEYS_DEPTH = 32  # arrays and objects nested in extra_keys, at most (vLLM's are 1 or 2 deep)


def key_hash(key: str) -> int:
    """The block hash of a block stored without ``Kvstore-Block-Meta``: the
    xxh3-64 of its key's UTF-8 bytes, as an unsigned integer."""
    return xxhash.xxh3_64_intdigest(key.encode())


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """The engine's identity of a block (as vLLM's ``BlockStored`` has it)."""

    block_hash: int
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: Any = None

    @classmethod
    def of_key(cls, key: str) -> BlockMeta:
        return cls(key_hash(key))

    def as_dict(self) -> dict[str, Any]:
        return {
            "block_hash": self.block_hash,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": list(self.token_ids),
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "lora_name": self.lora_name,
            "extra_keys": self.extra_keys,
        }

    def pack(self) -> bytes:
        """Compact JSON, for the index."""
        return json.dumps(self.as_dict(), separators=(",", ":")).encode()

    @classmethod
    def unpack(cls, raw: bytes) -> BlockMeta:
        return _from_doc(json.loads(raw), "stored block metadata")

    @classmethod
    def from_doc(cls, doc: Any, where: str) -> BlockMeta:
        """An already parsed JSON object."""
        return _from_doc(doc, where)

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> BlockMeta:
        """The JSON object itself (a batch item's identity)."""
        return _from_doc(jsonlimits.loads(raw, where, EXTRA_KEYS_DEPTH + 1), where)

    @classmethod
    def from_header(cls, value: str) -> BlockMeta:
        """``Kvstore-Block-Meta``: base64url (padding optional) of a JSON object."""
        try:
            raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        except (binascii.Error, ValueError):
            raise InvalidInput(f"header {META_HEADER!r} must be base64url of a JSON object") from None
        if len(raw) > META_MAX:
            raise InvalidInput(f"header {META_HEADER!r} is over {META_MAX} bytes of JSON")
        where = f"header {META_HEADER!r}"
        doc = jsonlimits.loads(raw, where, EXTRA_KEYS_DEPTH + 1, expected="base64url of a JSON object")
        return _from_doc(doc, where)


def _int(doc: dict[str, Any], name: str, where: str, nullable: bool, lo: int, hi: int) -> int | None:
    value = doc.get(name)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        what = "an integer" + (" or null" if nullable else "")
        raise InvalidInput(f"{where}: field {name!r} must be {what} in [{lo}, {hi}]; got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """A wrong value as a message names it: a scalar's repr, cut to 40
    characters; for an array or object, its type."""
    if isinstance(value, list | dict):
        return "an array" if isinstance(value, list) else "an object"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _from_doc(doc: Any, where: str) -> BlockMeta:
    if not isinstance(doc, dict):
        raise InvalidInput(f"{where} must be a JSON object")
    known = {"block_hash", "parent_block_hash", "token_ids", "block_size", "lora_id", "lora_name", "extra_keys"}
    unknown = set(doc) - known
    if unknown:
        raise InvalidInput(f"{where}: unknown field(s) {', '.join(sorted(unknown)[:8])[:200]}")
    # An identity is published in every event about its block (SSE's JSON,
    # ZMQ's msgpack, which refuses more than 511 levels): bounded here.
    if jsonlimits.deeper_than(doc.get("extra_keys"), EXTRA_KEYS_DEPTH):
        raise InvalidInput(f"{where}: field 'extra_keys' nests arrays or objects more than {EXTRA_KEYS_DEPTH} deep")
    h64 = (-(1 << 63), (1 << 64) - 1)  # signed or unsigned 64-bit: engines use either
    block_hash = _int(doc, "block_hash", where, False, *h64)
    assert block_hash is not None
    tokens = doc.get("token_ids", [])
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens
    ):
        raise InvalidInput(f"{where}: field 'token_ids' must be a list of token ids (integers in [0, 2^32))")
    lora_name = doc.get("lora_name")
    if lora_name is not None and (not isinstance(lora_name, str) or len(lora_name) > 256):
        raise InvalidInput(f"{where}: field 'lora_name' must be a string of at most 256 characters or null")
    size = _int(doc, "block_size", where, False, 0, 1 << 20) if "block_size" in doc else len(tokens)
    return BlockMeta(
        block_hash,
        _int(doc, "parent_block_hash", where, True, *h64),
        tuple(tokens),
        size or 0,
        _int(doc, "lora_id", where, True, -(1 << 31), (1 << 31) - 1),
        lora_name,
        doc.get("extra_keys"),
    )


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    ts: float  # seconds since the epoch
    tenant: str
    kind: Kind
    cause: str  # put, deleted, expired, quota, evicted, moved, rehydrated, tenant_deleted
    tier: TierName | None = None  # None for cleared
    keys: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()  # stored: the blocks' sizes (bytes), in the order of keys
    metas: tuple[BlockMeta, ...] = field(default=())  # stored and removed: one per key
    topic: str = ""  # the tenant's events topic when it happened ("": its name)

    def as_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"seq": self.seq, "ts": self.ts, "tenant": self.tenant, "kind": self.kind}
        doc["cause"] = self.cause
        if self.kind != "cleared":
            doc["tier"] = self.tier
            doc["blocks"] = [
                {"key": k, **({"size": self.sizes[i]} if self.sizes else {}), **self.metas[i].as_dict()}
                for i, k in enumerate(self.keys)
            ]
        return doc

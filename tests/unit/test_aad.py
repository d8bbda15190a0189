"""The additional data (and key-derivation info) each sealed thing is bound
to, pinned byte for byte.

What a wrapped data key, an S3 secret, a sealed ident, a gateway record or a
frame was sealed with is on disk and in buckets: the bytes bound to it must
be exactly those of the release that sealed it, or nothing opens. The
literals below are what the builders wrote before they were made one
(kvstore_client/wire/sealing.py, ``aad``); a change to any of them is a
format change (docs/operations.md, "Formats"), never a refactor. The sealed
values were made by that release too: opening them checks the whole path,
not just the builder.
"""

from __future__ import annotations

from kvstore_client.wire.sealing import FrameBinding

from kvstore.buckets import records as bucket_records
from kvstore.engine import crypto, registry, store_core
from kvstore.engine.crypto import MasterKey, derive_frame_key

RECORD_ID = bytes(range(16))


def test_a_wrapped_data_key_is_bound_to_its_tenant_and_version() -> None:
    assert crypto._wrap_aad("acme", 3) == b"kvstore/v1 wrapped data key\x00acme\x003"
    assert crypto._wrap_aad("t-1", 12345) == b"kvstore/v1 wrapped data key\x00t-1\x0012345"


def test_an_s3_secret_is_bound_to_its_tenant_and_access_key_id() -> None:
    assert registry._s3_aad("acme", "KVSABCDEFGHIJKLMNOP") == b"kvstore/v1 s3 secret\x00acme\x00KVSABCDEFGHIJKLMNOP"


def test_a_sealed_ident_is_bound_to_its_tenant_and_key() -> None:
    assert store_core._ident_aad("acme", "blk:0001") == b"kvstore/v1 ident\x00acme\x00blk:0001"


def test_a_gateway_record_is_bound_to_its_tenant_and_key() -> None:
    assert bucket_records._aad("acme", "mpu.obj") == b"kvstore/v1 s3 record\x00acme\x00mpu.obj"


def test_a_frame_is_bound_to_its_record_index_tenant_and_key() -> None:
    binding = FrameBinding(RECORD_ID, 2, 5, 4096 * 5 - 7, "acme", "blk:0001")
    assert binding.aad(4) == (
        b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\t\n\x0b\x0c\r\x0e\x0f"  # record id
        b"\x02\x00\x00\x00"  # key version
        b"\x04\x00\x00\x00"  # frame index
        b"\x05\x00\x00\x00"  # frame count
        b"\xf9O\x00\x00\x00\x00\x00\x00"  # size
        b"\x00acme\x00blk:0001"
    )


def test_a_frame_key_is_derived_for_its_tenant_and_version() -> None:
    key = derive_frame_key(bytes(range(32)), RECORD_ID, "acme", 2)
    assert key.hex() == "b8b46236457bd35a9e981d451bfbf42d7b9087577b0e1a180ae09d535535084f"


MASTER = MasterKey(bytes(range(100, 132)))
WRAPPED = "iznfaIVqNIZlhuy7DI7qB3kzvSwKqQY72FSUpe88f0swR7K91I7W2HJ7T+Pau+nDYTB5WDZpDG+WVV0C"
SEALED_S3_SECRET = "RrlQZS2L3QOgQMLprvxwmxE5vW8fy3rZOsQkMzjtLlTEwOP/wORw8Ao0"


def test_a_data_key_wrapped_before_still_unwraps() -> None:
    assert MASTER.unwrap(WRAPPED, "acme", 3) == bytes(range(200, 232))


def test_an_s3_secret_sealed_before_still_opens() -> None:
    aad = registry._s3_aad("acme", "KVSABCDEFGHIJKLMNOP")
    assert MASTER.open(SEALED_S3_SECRET, aad) == b"s3 secret text"

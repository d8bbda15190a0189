"""SigV4 checked against AWS's own published examples (known answers), so the
verifier is right by S3's definition, not by agreement with one client.

Examples from "Signature Calculations for the Authorization Header" (GET
Object with a Range) and "Signature Calculation: Transfer Payload in Multiple
Chunks" (a streaming PUT of 66,560 bytes of "a" in chunks of 64 KiB and
1 KiB), Amazon S3 API Reference, with AWS's example credentials.
"""

from __future__ import annotations

import hashlib

import pytest

from kvstore.transport.s3.errors import S3Error
from kvstore.transport.s3.sigv4 import (
    ChunkSigner,
    RequestParts,
    check_scope_and_time,
    parse_authorization,
    verify,
)

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
AKID = "AKIAIOSFODNN7EXAMPLE"
EXAMPLE_TIME = 1369353600  # 2013-05-24T00:00:00Z


def _auth(signed: str, signature: str) -> str:
    return (
        f"AWS4-HMAC-SHA256 Credential={AKID}/20130524/us-east-1/s3/aws4_request,"
        f"SignedHeaders={signed},Signature={signature}"
    )


def test_get_object_example() -> None:
    headers = {
        "host": ["examplebucket.s3.amazonaws.com"],
        "range": ["bytes=0-9"],
        "x-amz-content-sha256": [hashlib.sha256(b"").hexdigest()],
        "x-amz-date": ["20130524T000000Z"],
        "authorization": [
            _auth(
                "host;range;x-amz-content-sha256;x-amz-date",
                "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
            )
        ],
    }
    parts = RequestParts("GET", "/test.txt", "", headers)
    auth = parse_authorization(parts)
    assert auth is not None and auth.access_key_id == AKID
    check_scope_and_time(auth, "us-east-1", now=EXAMPLE_TIME + 60)
    verify(parts, auth, SECRET)
    with pytest.raises(S3Error) as e:
        verify(parts, auth, SECRET[:-1] + "X")
    assert e.value.s3_code == "SignatureDoesNotMatch"
    tampered = RequestParts("GET", "/test.txt", "", {**headers, "range": ["bytes=0-10"]})
    with pytest.raises(S3Error):
        verify(tampered, auth, SECRET)


def test_streaming_chunked_example() -> None:
    signed = (
        "content-encoding;content-length;host;x-amz-content-sha256;x-amz-date;"
        "x-amz-decoded-content-length;x-amz-storage-class"
    )
    headers = {
        "host": ["s3.amazonaws.com"],
        "x-amz-date": ["20130524T000000Z"],
        "x-amz-storage-class": ["REDUCED_REDUNDANCY"],
        "x-amz-content-sha256": ["STREAMING-AWS4-HMAC-SHA256-PAYLOAD"],
        "content-encoding": ["aws-chunked"],
        "x-amz-decoded-content-length": ["66560"],
        "content-length": ["66824"],
        "authorization": [_auth(signed, "4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9")],
    }
    parts = RequestParts("PUT", "/examplebucket/chunkObject.txt", "", headers)
    auth = parse_authorization(parts)
    assert auth is not None
    key = verify(parts, auth, SECRET)
    chain = ChunkSigner(key, auth)
    chain.check_chunk(
        hashlib.sha256(b"a" * 65536).hexdigest(), "ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648"
    )
    chain.check_chunk(
        hashlib.sha256(b"a" * 1024).hexdigest(), "0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497"
    )
    chain.check_chunk(
        hashlib.sha256(b"").hexdigest(), "b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9"
    )
    # A chunk replayed out of order, or with other bytes, breaks the chain.
    replay = ChunkSigner(key, auth)
    with pytest.raises(S3Error):
        replay.check_chunk(
            hashlib.sha256(b"b" * 65536).hexdigest(),
            "ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648",
        )


def test_scope_and_clock() -> None:
    headers = {
        "host": ["h"],
        "x-amz-date": ["20130524T000000Z"],
        "x-amz-content-sha256": ["UNSIGNED-PAYLOAD"],
        "authorization": [_auth("host;x-amz-content-sha256;x-amz-date", "0" * 64)],
    }
    auth = parse_authorization(RequestParts("GET", "/", "", headers))
    assert auth is not None
    with pytest.raises(S3Error) as e:
        check_scope_and_time(auth, "us-east-1", now=EXAMPLE_TIME + 16 * 60)
    assert e.value.s3_code == "RequestTimeTooSkewed"
    with pytest.raises(S3Error) as e:
        check_scope_and_time(auth, "eu-west-1", now=EXAMPLE_TIME)
    assert e.value.s3_code == "AuthorizationHeaderMalformed"
    check_scope_and_time(auth, "us-east-1", now=EXAMPLE_TIME - 14 * 60)

"""SigV4 as the gateway enforces it, and tenants kept apart: every failure
S3 defines, with real signatures made by botocore (and, for streaming
uploads, chunk signatures per AWS's specification)."""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import os
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from botocore.exceptions import ClientError

from tests.s3.conftest import Answer, Gateway, http_error, send_signed
from tests.s3.test_gateway_ops import code_of, fresh_bucket, status_of


def test_unknown_key_wrong_secret_and_revoked_key(gateway: Gateway) -> None:
    akid, secret = gateway.keys["acme"]
    with pytest.raises(ClientError) as e:
        gateway.client(key=("KVSNOSUCHKEY00000000", secret)).list_buckets()
    assert code_of(e) == "InvalidAccessKeyId" and status_of(e) == 403
    with pytest.raises(ClientError) as e:
        gateway.client(key=(akid, secret[:-1] + ("A" if secret[-1] != "A" else "B"))).list_buckets()
    assert code_of(e) == "SignatureDoesNotMatch" and status_of(e) == 403
    extra = gateway.admin("POST", "/v1/admin/tenants/acme/s3-keys")
    client = gateway.client(key=(extra["access_key_id"], extra["secret_access_key"]))
    client.list_buckets()
    listed = gateway.admin("GET", "/v1/admin/tenants/acme/s3-keys")["s3_keys"]
    assert extra["access_key_id"] in [k["access_key_id"] for k in listed]
    assert extra["secret_access_key"] not in json.dumps(listed)
    registry = (gateway.daemon.data_dir / "registry.json").read_text()
    assert extra["access_key_id"] in registry and extra["secret_access_key"] not in registry  # sealed at rest
    gateway.admin("DELETE", f"/v1/admin/tenants/acme/s3-keys/{extra['access_key_id']}")
    with pytest.raises(ClientError) as e:
        client.list_buckets()
    assert code_of(e) == "InvalidAccessKeyId"
    assert http_error(gateway.admin, "DELETE", f"/v1/admin/tenants/acme/s3-keys/{extra['access_key_id']}")[0] == 404
    assert http_error(gateway.admin, "DELETE", "/v1/admin/tenants/acme/s3-keys/bad-id!")[0] == 400


@pytest.mark.parametrize(("shift_s", "ok"), [(-20 * 60, False), (20 * 60, False), (-14 * 60, True), (14 * 60, True)])
def test_clock_skew_window(gateway: Gateway, shift_s: int, ok: bool) -> None:
    """A request signed 20 minutes ago (a replay) or ahead is refused; within
    S3's 15 minutes it is accepted. The client's clock is what is skewed
    (botocore's Python signer; boto3 signs with the CRT's when it is installed)."""
    skewed = dt.datetime.now(dt.UTC).replace(tzinfo=None) + dt.timedelta(seconds=shift_s)
    with mock.patch("botocore.auth.get_current_datetime", return_value=skewed):
        answer = send_signed(gateway, "GET", "/", gateway.keys["acme"])
    if ok:
        assert answer.status == 200, answer.body
    else:
        assert (answer.status, answer.code) == (403, "RequestTimeTooSkewed")


def test_anonymous_wrong_region_and_unsigned_headers(gateway: Gateway) -> None:
    status, body = http_error(urllib.request.urlopen, gateway.endpoint + "/")
    assert status == 403
    assert b"<Code>AccessDenied</Code>" in body and b"<RequestId>" in body
    key = gateway.keys["acme"]
    wrong = send_signed(gateway, "GET", "/", key, region="eu-west-1")
    assert (wrong.status, wrong.code) == (400, "AuthorizationHeaderMalformed")
    sneaky = send_signed(gateway, "GET", "/", key, extra_headers={"x-amz-meta-added": "after signing"})
    assert (sneaky.status, sneaky.code) == (403, "AccessDenied")


def test_payload_hash_checked(gateway: Gateway) -> None:
    s3 = gateway.client("acme")
    bucket = fresh_bucket(s3)
    key = gateway.keys["acme"]
    body = os.urandom(50_000)
    ok = send_signed(gateway, "PUT", f"/{bucket}/ph", key, body=body)
    assert ok.status == 200, ok.body
    forged = bytearray(body)
    forged[100] ^= 1
    bad = send_signed(gateway, "PUT", f"/{bucket}/ph2", key, body=body, send_body=bytes(forged))
    assert (bad.status, bad.code) == (400, "XAmzContentSHA256Mismatch")
    unsigned = send_signed(gateway, "PUT", f"/{bucket}/ph3", key, body=body, payload_hash="UNSIGNED-PAYLOAD")
    assert unsigned.status == 200
    tampered_header = send_signed(
        gateway,
        "PUT",
        f"/{bucket}/ph4",
        key,
        body=body,
        payload_hash="UNSIGNED-PAYLOAD",
        extra_headers={"x-amz-content-sha256": hashlib.sha256(body).hexdigest()},
    )
    assert (tampered_header.status, tampered_header.code) == (403, "SignatureDoesNotMatch")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == ["ph", "ph3"]  # nothing of a refused upload is kept


def _signing_key(secret: str, date: str, region: str = "us-east-1") -> bytes:
    k = hmac.new(b"AWS4" + secret.encode(), date.encode(), hashlib.sha256).digest()
    for part in (region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    return k


def _chunked(
    gateway: Gateway,
    bucket: str,
    name: str,
    data: bytes,
    chunk: int,
    tamper: int | None = None,
    trailer: str | None = None,
) -> Answer:
    """A signed streaming upload (STREAMING-AWS4-HMAC-SHA256-PAYLOAD, or the
    -TRAILER variant with a CRC32 trailer), as the Java and Go SDKs send it:
    the seed signature from botocore's signer, each chunk's per AWS's spec."""
    akid, secret = gateway.keys["acme"]
    mode = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD" + ("-TRAILER" if trailer is not None else "")
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] + [b""]
    headers = {"Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(data))}
    if trailer is not None:
        headers["x-amz-trailer"] = "x-amz-checksum-crc32"
    # Sign the headers first: the chunk framing depends on the seed signature.
    probe: dict[str, Any] = {}

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    class Signer(S3SigV4Auth):  # type: ignore[misc]
        def payload(self, request: Any) -> str:
            return mode

    req = AWSRequest(method="PUT", url=f"{gateway.endpoint}/{bucket}/{name}", data=b"", headers=headers)
    Signer(Credentials(akid, secret), "s3", "us-east-1").add_auth(req)
    auth = req.headers["Authorization"]
    amz_date = req.headers["X-Amz-Date"]
    previous = auth.rpartition("Signature=")[2]
    scope = f"{amz_date[:8]}/us-east-1/s3/aws4_request"
    skey = _signing_key(secret, amz_date[:8])
    out = bytearray()
    for i, piece in enumerate(pieces):
        text = "\n".join(
            [
                "AWS4-HMAC-SHA256-PAYLOAD",
                amz_date,
                scope,
                previous,
                hashlib.sha256(b"").hexdigest(),
                hashlib.sha256(piece).hexdigest(),
            ]
        )
        sig = hmac.new(skey, text.encode(), hashlib.sha256).hexdigest()
        previous = sig
        sent = piece
        if tamper == i:
            sent = bytes([piece[0] ^ 1]) + piece[1:]
        out += f"{len(piece):x};chunk-signature={sig}\r\n".encode() + sent + (b"\r\n" if piece else b"")
    if trailer is not None:
        line = f"x-amz-checksum-crc32:{trailer}".encode()
        text = "\n".join(
            ["AWS4-HMAC-SHA256-TRAILER", amz_date, scope, previous, hashlib.sha256(line + b"\n").hexdigest()]
        )
        tsig = hmac.new(skey, text.encode(), hashlib.sha256).hexdigest()
        out += line + b"\r\n" + f"x-amz-trailer-signature:{tsig}\r\n".encode() + b"\r\n"
    else:
        out += b"\r\n"
    del probe
    import http.client

    sent_headers = {k: str(v) for k, v in req.headers.items()}
    sent_headers["Content-Length"] = str(len(out))
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    try:
        conn.request("PUT", f"/{bucket}/{name}", body=bytes(out), headers=sent_headers)
        resp = conn.getresponse()
        return Answer(resp.status, dict(resp.getheaders()), resp.read())
    finally:
        conn.close()


def test_signed_streaming_uploads(gateway: Gateway) -> None:
    s3 = gateway.client("acme")
    bucket = fresh_bucket(s3)
    data = os.urandom(5 * (1 << 20) + 777)
    ok = _chunked(gateway, bucket, "stream", data, 64 << 10)
    assert ok.status == 200, ok.body
    got = s3.get_object(Bucket=bucket, Key="stream")
    assert got["Body"].read() == data
    assert "ContentEncoding" not in got  # aws-chunked is the transfer's, not the object's
    bad = _chunked(gateway, bucket, "tampered", data, 64 << 10, tamper=3)
    assert (bad.status, bad.code) == (403, "SignatureDoesNotMatch")
    crc = __import__("base64").b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    with_trailer = _chunked(gateway, bucket, "trailer", data, 1 << 20, trailer=crc)
    assert with_trailer.status == 200, with_trailer.body
    assert s3.get_object(Bucket=bucket, Key="trailer")["Body"].read() == data
    wrong_crc = _chunked(gateway, bucket, "badcrc", data, 1 << 20, trailer="AAAAAA==")
    assert (wrong_crc.status, wrong_crc.code) == (400, "BadDigest")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == ["stream", "trailer"]


def test_presigned_urls(gateway: Gateway) -> None:
    s3 = gateway.client("acme")
    bucket = fresh_bucket(s3)
    put_url = s3.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "p"}, ExpiresIn=300)
    data = os.urandom(10_000)
    with urllib.request.urlopen(urllib.request.Request(put_url, data=data, method="PUT")) as r:
        assert r.status == 200
    get_url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "p"}, ExpiresIn=300)
    with urllib.request.urlopen(get_url) as r:
        assert r.read() == data
    other = get_url.replace(f"/{bucket}/p?", f"/{bucket}/q?")
    status, body = http_error(urllib.request.urlopen, other)
    assert status == 403 and b"SignatureDoesNotMatch" in body
    from botocore.auth import S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method="GET", url=f"{gateway.endpoint}/{bucket}/p")
    S3SigV4QueryAuth(Credentials(*gateway.keys["acme"]), "s3", "us-east-1", expires=0).add_auth(req)
    zero = req.url  # boto3's presigner refuses 0 s itself; botocore's signer makes the URL
    time.sleep(1.1)
    status, body = http_error(urllib.request.urlopen, zero)
    assert status == 403 and b"<Code>AccessDenied</Code>" in body  # valid for no time: expired
    short = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "p"}, ExpiresIn=1)
    time.sleep(2.1)
    status, body = http_error(urllib.request.urlopen, short)
    assert status == 403 and b"<Code>AccessDenied</Code>" in body
    too_long = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "p"}, ExpiresIn=700_000)
    status, body = http_error(urllib.request.urlopen, too_long)
    assert status == 400 and b"AuthorizationQueryParametersError" in body


def test_tenants_kept_apart(gateway: Gateway) -> None:
    acme, beta = gateway.client("acme"), gateway.client("beta")
    bucket = fresh_bucket(acme)
    acme.put_object(Bucket=bucket, Key="secret", Body=b"acme's bytes")
    assert bucket not in [b["Name"] for b in beta.list_buckets()["Buckets"]]
    calls: list[Callable[[], Any]] = [
        lambda: beta.head_bucket(Bucket=bucket),
        lambda: beta.list_objects_v2(Bucket=bucket),
        lambda: beta.get_object(Bucket=bucket, Key="secret"),
        lambda: beta.head_object(Bucket=bucket, Key="secret"),
        lambda: beta.put_object(Bucket=bucket, Key="secret", Body=b"overwritten"),
        lambda: beta.delete_object(Bucket=bucket, Key="secret"),
        lambda: beta.delete_bucket(Bucket=bucket),
        lambda: beta.create_multipart_upload(Bucket=bucket, Key="x"),
        lambda: beta.copy_object(
            Bucket=fresh_bucket(beta), Key="stolen", CopySource={"Bucket": bucket, "Key": "secret"}
        ),
    ]
    for call in calls:
        with pytest.raises(ClientError) as e:
            call()
        assert status_of(e) == 403, e.value.response
    with pytest.raises(ClientError) as e:
        beta.create_bucket(Bucket=bucket)
    assert code_of(e) == "BucketAlreadyExists"
    url = beta.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "secret"}, ExpiresIn=60)
    status, body = http_error(urllib.request.urlopen, url)
    assert status == 403 and b"acme's bytes" not in body
    assert acme.get_object(Bucket=bucket, Key="secret")["Body"].read() == b"acme's bytes"


def test_malformed_xml(gateway: Gateway) -> None:
    s3 = gateway.client("acme")
    bucket = fresh_bucket(s3)
    key = gateway.keys["acme"]
    up = s3.create_multipart_upload(Bucket=bucket, Key="x")["UploadId"]
    for body in (
        b"<CompleteMultipartUpload><Part>",
        b"not xml",
        b"<Other/>",
        b'<!DOCTYPE x [<!ENTITY a "aaaa">]><CompleteMultipartUpload>&a;</CompleteMultipartUpload>',
        b"<CompleteMultipartUpload><Part><PartNumber>x</PartNumber><ETag>e</ETag></Part></CompleteMultipartUpload>",
    ):
        a = send_signed(gateway, "POST", f"/{bucket}/x?uploadId={up}", key, body=body)
        assert (a.status, a.code) == (400, "MalformedXML"), body
    md5 = __import__("base64").b64encode(hashlib.md5(b"<Delete><Object>").digest()).decode()
    a = send_signed(gateway, "POST", f"/{bucket}?delete", key, body=b"<Delete><Object>", headers={"Content-MD5": md5})
    assert (a.status, a.code) == (400, "MalformedXML")
    a = send_signed(gateway, "POST", f"/{bucket}?delete", key, body=b"<Delete/>")
    assert (a.status, a.code) == (400, "InvalidRequest")  # S3 requires Content-MD5 (or a checksum) here
    a = send_signed(gateway, "PUT", f"/{bucket}", key, body=b"<CreateBucketConfiguration><LocationConstraint>")
    assert a.status == 400
    a = send_signed(gateway, "GET", f"/{bucket}?tagging", key)
    assert (a.status, a.code) == (501, "NotImplemented")


def _expect_exchange(gateway: Gateway, key: tuple[str, str], path: str, body: bytes) -> tuple[bytes, bytes]:
    """Send a signed PUT's headers with ``Expect: 100-continue``; (the first
    answer, the final answer after sending the body if the first was 100)."""
    import socket

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method="PUT", url=gateway.endpoint + path, data=body)
    S3SigV4Auth(Credentials(*key), "s3", "us-east-1").add_auth(req)
    head = f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1:{gateway.port}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in req.headers.items()
    )
    head += f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(head.encode())
        first = sock.recv(65536)
        if not first.startswith(b"HTTP/1.1 100"):
            return first, b""
        sock.sendall(body)
        rest = b""
        while b"\r\n\r\n" not in rest:
            rest += sock.recv(65536)
        return first, rest


def test_expect_100_continue_is_answered_after_authentication(gateway: Gateway) -> None:
    """As S3: a request that would be refused is refused before its body is
    sent; one that will be accepted gets 100 Continue, then its answer."""
    s3 = gateway.client("acme")
    bucket = fresh_bucket(s3)
    body = os.urandom(200_000)
    first, final = _expect_exchange(gateway, gateway.keys["acme"], f"/{bucket}/expect", body)
    assert first.startswith(b"HTTP/1.1 100") and final.startswith(b"HTTP/1.1 200"), (first[:80], final[:80])
    assert s3.get_object(Bucket=bucket, Key="expect")["Body"].read() == body
    akid, secret = gateway.keys["acme"]
    first, _ = _expect_exchange(gateway, (akid, "wrong" + secret[5:]), f"/{bucket}/expect2", body)
    assert first.startswith(b"HTTP/1.1 403") and b"SignatureDoesNotMatch" in first
    first, _ = _expect_exchange(gateway, gateway.keys["beta"], f"/{bucket}/expect3", body)
    assert first.startswith(b"HTTP/1.1 403") and b"AccessDenied" in first  # another tenant's bucket


def test_acls_accepted_and_access_stays_private(gateway: Gateway) -> None:
    """ACL requests are accepted and change nothing: the ACL in force is the
    owner's full control, and a "public" object is still refused to an
    anonymous reader and to another tenant."""
    s3, beta = gateway.client("acme"), gateway.client("beta")
    bucket = fresh_bucket(s3)
    s3.put_object(Bucket=bucket, Key="o", Body=b"x", ACL="public-read")
    s3.put_bucket_acl(Bucket=bucket, ACL="public-read-write")
    s3.put_object_acl(Bucket=bucket, Key="o", ACL="bucket-owner-full-control")
    s3.put_object(Bucket=bucket, Key="g", Body=b"y", GrantRead="uri=http://acs.amazonaws.com/groups/global/AllUsers")
    for acl in (s3.get_bucket_acl(Bucket=bucket), s3.get_object_acl(Bucket=bucket, Key="o")):
        assert [g["Permission"] for g in acl["Grants"]] == ["FULL_CONTROL"]
        assert acl["Owner"]["ID"] == "acme" and acl["Grants"][0]["Grantee"]["ID"] == "acme"
    for key in ("o", "g"):
        status, body = http_error(urllib.request.urlopen, f"{gateway.endpoint}/{bucket}/{key}")
        assert status == 403 and body.count(b"<Code>AccessDenied</Code>") == 1
        with pytest.raises(ClientError) as e:
            beta.get_object(Bucket=bucket, Key=key)
        assert status_of(e) == 403
    with pytest.raises(ClientError) as e:
        s3.get_object_acl(Bucket=bucket, Key="absent")
    assert code_of(e) == "NoSuchKey"
    with pytest.raises(ClientError) as e:
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    assert code_of(e) == "NotImplemented"  # refused, not ignored: a client would count on old versions
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Suspended"})
    versions = s3.list_object_versions(Bucket=bucket)
    assert [(v["Key"], v["VersionId"], v["IsLatest"]) for v in versions["Versions"]] == [
        ("g", "null", True),
        ("o", "null", True),
    ]
    assert s3.get_object(Bucket=bucket, Key="o", VersionId="null")["Body"].read() == b"x"
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="o", VersionId="3HL4kqtJlcpXroDTDmJ")
    assert code_of(e) == "InvalidArgument"

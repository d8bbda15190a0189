"""Every S3 operation of the gateway with boto3 over 127.0.0.1: real SigV4
signatures, a real daemon, bytes checked against what was written."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import random
import time
import urllib.request
import zlib
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from tests.s3.conftest import Gateway

MiB = 1 << 20


def code_of(e: pytest.ExceptionInfo[ClientError]) -> str:
    return str(e.value.response["Error"]["Code"])


def status_of(e: pytest.ExceptionInfo[ClientError]) -> int:
    return int(e.value.response["ResponseMetadata"]["HTTPStatusCode"])


@pytest.fixture(scope="module", params=["acme", "beta"])
def s3(request: pytest.FixtureRequest, gateway: Gateway) -> Any:
    """A client of the sealed tenant, then of the direct one: every test runs on both."""
    return gateway.client(request.param)


def fresh_bucket(s3: Any) -> str:
    name = f"bkt-{os.urandom(4).hex()}"
    s3.create_bucket(Bucket=name)
    return name


def test_bucket_lifecycle(gateway: Gateway, s3: Any) -> None:
    name = fresh_bucket(s3)
    assert name in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert s3.head_bucket(Bucket=name)["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert s3.get_bucket_location(Bucket=name)["LocationConstraint"] is None  # us-east-1, as S3 says it
    s3.put_object(Bucket=name, Key="kept", Body=b"x")
    s3.create_bucket(Bucket=name)  # S3's us-east-1 answers success to its owner and changes nothing
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=name)["Contents"]] == ["kept"]
    s3.delete_object(Bucket=name, Key="kept")
    with pytest.raises(ClientError) as e:
        s3.create_bucket(Bucket=name + "-eu", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    assert code_of(e) == "IllegalLocationConstraintException"
    mine = [b["Name"] for b in s3.list_buckets()["Buckets"]]
    paged: list[str] = []
    token: dict[str, str] = {}
    while True:
        page = s3.list_buckets(MaxBuckets=1, **token)
        paged += [b["Name"] for b in page["Buckets"]]
        if "ContinuationToken" not in page:
            break
        token = {"ContinuationToken": page["ContinuationToken"]}
    assert paged == mine and len(mine) >= 1
    assert [b["Name"] for b in s3.list_buckets(Prefix=name)["Buckets"]] == [name]
    for bad in ("ab", "Upper", "a..b", "192.168.1.1", "-abc", "x" * 64):
        with pytest.raises(ClientError) as e:
            s3.create_bucket(Bucket=bad)
        assert code_of(e) == "InvalidBucketName", bad
    s3.create_bucket(Bucket=name + "-cfg", CreateBucketConfiguration={"LocationConstraint": "us-east-1"}, ACL="private")
    s3.delete_bucket(Bucket=name + "-cfg")
    s3.put_object(Bucket=name, Key="k", Body=b"x")
    with pytest.raises(ClientError) as e:
        s3.delete_bucket(Bucket=name)
    assert code_of(e) == "BucketNotEmpty"
    s3.delete_object(Bucket=name, Key="k")
    s3.delete_bucket(Bucket=name)
    with pytest.raises(ClientError) as e:
        s3.head_bucket(Bucket=name)
    assert status_of(e) == 404
    with pytest.raises(ClientError) as e:
        s3.list_objects_v2(Bucket=name)
    assert code_of(e) == "NoSuchBucket"


@pytest.mark.parametrize("size", [0, 1, 4 * MiB - 1, 4 * MiB, 4 * MiB + 1, 9 * MiB + 12345])
def test_put_get_sizes_and_etag(s3: Any, size: int) -> None:
    """Sizes around the block size (4 MiB here): objects of several blocks."""
    bucket = fresh_bucket(s3)
    data = os.urandom(size)
    put = s3.put_object(Bucket=bucket, Key="obj", Body=data)
    assert put["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
    got = s3.get_object(Bucket=bucket, Key="obj")
    assert got["Body"].read() == data
    assert got["ETag"] == put["ETag"] and got["ContentLength"] == size
    head = s3.head_object(Bucket=bucket, Key="obj")
    assert head["ContentLength"] == size and head["ETag"] == put["ETag"]


def test_ranged_reads(s3: Any) -> None:
    bucket = fresh_bucket(s3)
    data = os.urandom(10 * MiB + 7)
    s3.put_object(Bucket=bucket, Key="r", Body=data)
    rng = random.Random(7)
    cases = [(0, 0), (0, 9), (4 * MiB - 3, 4 * MiB + 3), (8 * MiB - 1, 8 * MiB), (len(data) - 1, len(data) - 1)]
    cases += [(a, a + rng.randrange(1, 3 * MiB)) for a in (rng.randrange(len(data) - 3 * MiB) for _ in range(8))]
    for first, last in cases:
        got = s3.get_object(Bucket=bucket, Key="r", Range=f"bytes={first}-{last}")
        assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert got["ContentRange"] == f"bytes {first}-{last}/{len(data)}"
        assert got["Body"].read() == data[first : last + 1], (first, last)
    assert s3.get_object(Bucket=bucket, Key="r", Range="bytes=-100")["Body"].read() == data[-100:]
    assert s3.get_object(Bucket=bucket, Key="r", Range=f"bytes={len(data) - 5}-")["Body"].read() == data[-5:]
    assert s3.get_object(Bucket=bucket, Key="r", Range="bytes=5-1000000000")["Body"].read() == data[5:]
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="r", Range=f"bytes={len(data)}-")
    assert code_of(e) == "InvalidRange" and status_of(e) == 416
    # Invalid syntax is ignored (RFC 9110): the whole object.
    whole = s3.get_object(Bucket=bucket, Key="r", Range="bytes=abc")
    assert whole["ResponseMetadata"]["HTTPStatusCode"] == 200 and whole["Body"].read() == data


def test_metadata_and_conditions(s3: Any) -> None:
    bucket = fresh_bucket(s3)
    put = s3.put_object(
        Bucket=bucket,
        Key="m",
        Body=b"hello",
        ContentType="text/plain",
        CacheControl="no-cache",
        ContentDisposition="attachment",
        Metadata={"model": "llama", "layer": "3"},
    )
    etag = put["ETag"]
    head = s3.head_object(Bucket=bucket, Key="m")
    assert head["ContentType"] == "text/plain" and head["Metadata"] == {"model": "llama", "layer": "3"}
    assert head["CacheControl"] == "no-cache" and head["ContentDisposition"] == "attachment"
    assert s3.get_object(Bucket=bucket, Key="m", IfMatch=etag)["Body"].read() == b"hello"
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="m", IfMatch='"0000"')
    assert status_of(e) == 412
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="m", IfNoneMatch=etag)
    assert status_of(e) == 304
    future = time.time() + 3600
    past = time.time() - 3600
    import datetime as dt

    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="m", IfModifiedSince=dt.datetime.fromtimestamp(future, dt.UTC))
    assert status_of(e) == 304
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="m", IfUnmodifiedSince=dt.datetime.fromtimestamp(past, dt.UTC))
    assert status_of(e) == 412
    over = s3.get_object(Bucket=bucket, Key="m", ResponseContentType="application/x-kv")
    assert over["ContentType"] == "application/x-kv"
    # Conditional writes.
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="m", Body=b"other", IfNoneMatch="*")
    assert status_of(e) == 412
    s3.put_object(Bucket=bucket, Key="new", Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="m", Body=b"other", IfMatch='"ffff"')
    assert status_of(e) == 412
    s3.put_object(Bucket=bucket, Key="m", Body=b"other", IfMatch=etag)
    assert s3.get_object(Bucket=bucket, Key="m")["Body"].read() == b"other"
    other = s3.head_object(Bucket=bucket, Key="m")["ETag"]
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="m", Body=b"third", IfNoneMatch=other)  # an entity tag: not this one
    assert status_of(e) == 412
    s3.put_object(Bucket=bucket, Key="m", Body=b"third", IfNoneMatch=etag)
    s3.put_object(Bucket=bucket, Key="m", Body=b"fourth", IfMatch="*")
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="absent", Body=b"x", IfMatch="*")
    assert code_of(e) == "NoSuchKey"
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="missing")
    assert code_of(e) == "NoSuchKey"


def test_upload_integrity_checks(s3: Any) -> None:
    bucket = fresh_bucket(s3)
    data = os.urandom(100_000)
    good_md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
    s3.put_object(Bucket=bucket, Key="ok", Body=data, ContentMD5=good_md5)
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="bad", Body=data, ContentMD5=base64.b64encode(b"0" * 16).decode())
    assert code_of(e) == "BadDigest"
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="bad", Body=data, ContentMD5="not base64!")
    assert code_of(e) == "InvalidDigest"
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    s3.put_object(Bucket=bucket, Key="crc", Body=data, ChecksumCRC32=crc)
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="bad", Body=data, ChecksumCRC32="AAAAAA==")
    assert code_of(e) == "BadDigest"
    for algo in ("SHA256", "SHA1", "CRC32C"):
        s3.put_object(Bucket=bucket, Key="algo-" + algo, Body=data, ChecksumAlgorithm=algo)
        got = s3.get_object(Bucket=bucket, Key="algo-" + algo, ChecksumMode="ENABLED")
        assert got["Body"].read() == data
    with pytest.raises(ClientError) as e:
        s3.head_object(Bucket=bucket, Key="bad")
    assert status_of(e) == 404  # nothing of a refused upload is kept


def test_listing_thousands_of_keys(s3: Any) -> None:
    bucket = fresh_bucket(s3)
    rng = random.Random(3)
    keys = {f"dir{d}/sub{rng.randrange(5)}/obj-{i:05d}" for d in range(4) for i in range(500)}
    keys |= {f"top-{i}" for i in range(30)}
    keys |= {"odd/sp ace", "odd/pl+us", "odd/per%cent", "odd/ünï©ødé", "odd/日本", "odd/a\x7fb", "odd/" + "k" * 1000}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=bucket, Key=k, Body=k.encode()[:16]), keys))
    expected = sorted(keys, key=lambda k: k.encode())
    listed = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    assert listed == expected
    small = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, PaginationConfig={"PageSize": 37})
        for o in page.get("Contents", [])
    ]
    assert small == expected
    v1 = [
        o["Key"]
        for page in s3.get_paginator("list_objects").paginate(Bucket=bucket, PaginationConfig={"PageSize": 333})
        for o in page.get("Contents", [])
    ]
    assert v1 == expected
    # Delimiter: common prefixes count toward max-keys and page like keys.
    top = s3.list_objects_v2(Bucket=bucket, Delimiter="/")
    assert [p["Prefix"] for p in top["CommonPrefixes"]] == ["dir0/", "dir1/", "dir2/", "dir3/", "odd/"]
    assert [o["Key"] for o in top["Contents"]] == sorted(k for k in keys if "/" not in k)
    paged_prefixes: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Delimiter="/", Prefix="dir2/", PaginationConfig={"PageSize": 2}
    ):
        paged_prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        assert page["KeyCount"] <= 2
    assert paged_prefixes == sorted({k.rsplit("/", 1)[0] + "/" for k in keys if k.startswith("dir2/")})
    v1_prefixes: list[str] = []
    for page in s3.get_paginator("list_objects").paginate(
        Bucket=bucket, Delimiter="/", PaginationConfig={"PageSize": 2}
    ):
        v1_prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
    assert v1_prefixes == ["dir0/", "dir1/", "dir2/", "dir3/", "odd/"]
    after = s3.list_objects_v2(Bucket=bucket, StartAfter="dir3/sub4/obj-00000", Prefix="dir3/")
    assert [o["Key"] for o in after["Contents"]] == [
        k for k in expected if k.startswith("dir3/") and k > "dir3/sub4/obj-00000"
    ][:1000]
    odd = s3.list_objects_v2(Bucket=bucket, Prefix="odd/")
    assert [o["Key"] for o in odd["Contents"]] == sorted(
        (k for k in keys if k.startswith("odd/")), key=lambda k: k.encode()
    )
    zero = s3.list_objects_v2(Bucket=bucket, MaxKeys=0)
    assert zero["KeyCount"] == 0 and "Contents" not in zero
    with pytest.raises(ClientError) as e:
        s3.list_objects_v2(Bucket=bucket, ContinuationToken="@@@not-a-token@@@")
    assert code_of(e) == "InvalidArgument"
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="x" * 1025, Body=b"")
    assert code_of(e) == "KeyTooLongError"


def test_delete_objects(s3: Any) -> None:
    bucket = fresh_bucket(s3)
    for i in range(20):
        s3.put_object(Bucket=bucket, Key=f"d{i}", Body=b"x")
    out = s3.delete_objects(
        Bucket=bucket, Delete={"Objects": [{"Key": f"d{i}"} for i in range(10)] + [{"Key": "never"}]}
    )
    assert sorted(d["Key"] for d in out["Deleted"]) == sorted([f"d{i}" for i in range(10)] + ["never"])
    quiet = s3.delete_objects(
        Bucket=bucket, Delete={"Objects": [{"Key": f"d{i}"} for i in range(10, 20)], "Quiet": True}
    )
    assert not quiet.get("Deleted") and not quiet.get("Errors")
    assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] == 0
    s3.delete_object(Bucket=bucket, Key="never")  # deleting nothing is a success, as in S3


def test_copy_object(s3: Any) -> None:
    bucket = fresh_bucket(s3)
    data = os.urandom(5 * MiB + 3)
    s3.put_object(Bucket=bucket, Key="src", Body=data, Metadata={"a": "1"}, ContentType="x/y")
    out = s3.copy_object(Bucket=bucket, Key="dst", CopySource={"Bucket": bucket, "Key": "src"})
    assert out["CopyObjectResult"]["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
    got = s3.get_object(Bucket=bucket, Key="dst")
    assert got["Body"].read() == data and got["Metadata"] == {"a": "1"} and got["ContentType"] == "x/y"
    s3.copy_object(
        Bucket=bucket, Key="dst2", CopySource=f"{bucket}/src", MetadataDirective="REPLACE", Metadata={"b": "2"}
    )
    assert s3.head_object(Bucket=bucket, Key="dst2")["Metadata"] == {"b": "2"}
    s3.delete_object(Bucket=bucket, Key="src")
    assert s3.get_object(Bucket=bucket, Key="dst")["Body"].read() == data  # a copy, not a reference
    with pytest.raises(ClientError) as e:
        s3.copy_object(Bucket=bucket, Key="dst", CopySource={"Bucket": bucket, "Key": "dst"})
    assert code_of(e) == "InvalidRequest"


def test_multipart_100mib_and_ranged_reads(gateway: Gateway, s3: Any) -> None:
    bucket = fresh_bucket(s3)
    data = os.urandom(100 * MiB)
    cfg = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB, max_concurrency=4)
    s3.upload_fileobj(io.BytesIO(data), bucket, "big", Config=cfg)
    head = s3.head_object(Bucket=bucket, Key="big")
    assert head["ContentLength"] == len(data)
    parts = [data[i : i + 8 * MiB] for i in range(0, len(data), 8 * MiB)]
    md5s = b"".join(hashlib.md5(p).digest() for p in parts)
    assert head["ETag"] == f'"{hashlib.md5(md5s).hexdigest()}-{len(parts)}"'
    out = io.BytesIO()
    s3.download_fileobj(bucket, "big", out, Config=cfg)  # ranged GETs, concurrently
    assert hashlib.sha256(out.getvalue()).digest() == hashlib.sha256(data).digest()
    for first in (0, 8 * MiB - 10, 50 * MiB + 1, 100 * MiB - 5):
        got = s3.get_object(Bucket=bucket, Key="big", Range=f"bytes={first}-{first + 99}")["Body"].read()
        assert got == data[first : first + 100]
    part3 = s3.get_object(Bucket=bucket, Key="big", PartNumber=3)
    assert part3["PartsCount"] == len(parts) and part3["Body"].read() == parts[2]
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "big"}, ExpiresIn=60)
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=1000-1999"})) as r:
        assert r.status == 206 and r.read() == data[1000:2000]


def test_multipart_errors(s3: Any) -> None:
    bucket = fresh_bucket(s3)
    up = s3.create_multipart_upload(Bucket=bucket, Key="mp", Metadata={"x": "y"})["UploadId"]
    p1 = os.urandom(5 * MiB)
    p2 = os.urandom(1000)
    e1 = s3.upload_part(Bucket=bucket, Key="mp", UploadId=up, PartNumber=1, Body=p1)["ETag"]
    e2 = s3.upload_part(Bucket=bucket, Key="mp", UploadId=up, PartNumber=2, Body=p2)["ETag"]
    small = s3.upload_part(Bucket=bucket, Key="mp", UploadId=up, PartNumber=3, Body=b"tiny")["ETag"]
    listed = s3.list_parts(Bucket=bucket, Key="mp", UploadId=up)
    assert [(p["PartNumber"], p["Size"]) for p in listed["Parts"]] == [(1, 5 * MiB), (2, 1000), (3, 4)]
    assert s3.list_parts(Bucket=bucket, Key="mp", UploadId=up, MaxParts=2)["IsTruncated"] is True
    uploads = s3.list_multipart_uploads(Bucket=bucket)["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in uploads] == [("mp", up)]
    for number in (0, 10001):
        with pytest.raises(ClientError) as e:
            s3.upload_part(Bucket=bucket, Key="mp", UploadId=up, PartNumber=number, Body=b"x")
        assert code_of(e) == "InvalidArgument"
    cases: list[tuple[list[dict[str, Any]], str]] = [
        ([{"PartNumber": 1, "ETag": e1}, {"PartNumber": 4, "ETag": e2}], "InvalidPart"),  # missing part
        ([{"PartNumber": 1, "ETag": e2}], "InvalidPart"),  # wrong ETag
        ([{"PartNumber": 2, "ETag": e2}, {"PartNumber": 1, "ETag": e1}], "InvalidPartOrder"),
        ([{"PartNumber": 3, "ETag": small}, {"PartNumber": 2, "ETag": e2}], "InvalidPartOrder"),
        ([{"PartNumber": 2, "ETag": e2}, {"PartNumber": 3, "ETag": small}], "EntityTooSmall"),
    ]
    for parts, code in cases:
        with pytest.raises(ClientError) as e:
            s3.complete_multipart_upload(Bucket=bucket, Key="mp", UploadId=up, MultipartUpload={"Parts": parts})
        assert code_of(e) == code, parts
    done = s3.complete_multipart_upload(
        Bucket=bucket,
        Key="mp",
        UploadId=up,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e1}, {"PartNumber": 2, "ETag": e2}]},
    )
    assert done["ETag"].endswith('-2"')
    again = s3.complete_multipart_upload(  # a repeated Complete answers as the first did
        Bucket=bucket,
        Key="mp",
        UploadId=up,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e1}, {"PartNumber": 2, "ETag": e2}]},
    )
    assert again["ETag"] == done["ETag"]
    got = s3.get_object(Bucket=bucket, Key="mp")
    assert got["Body"].read() == p1 + p2 and got["Metadata"] == {"x": "y"}
    with pytest.raises(ClientError) as e:
        s3.list_parts(Bucket=bucket, Key="mp", UploadId=up)
    assert code_of(e) == "NoSuchUpload"
    up2 = s3.create_multipart_upload(Bucket=bucket, Key="gone")["UploadId"]
    s3.upload_part(Bucket=bucket, Key="gone", UploadId=up2, PartNumber=1, Body=b"x")
    s3.abort_multipart_upload(Bucket=bucket, Key="gone", UploadId=up2)
    with pytest.raises(ClientError) as e:
        s3.upload_part(Bucket=bucket, Key="gone", UploadId=up2, PartNumber=1, Body=b"x")
    assert code_of(e) == "NoSuchUpload"
    with pytest.raises(ClientError) as e:
        s3.abort_multipart_upload(Bucket=bucket, Key="gone", UploadId="0" * 32)
    assert code_of(e) == "NoSuchUpload"
    # UploadPartCopy, with a range.
    up3 = s3.create_multipart_upload(Bucket=bucket, Key="copied")["UploadId"]
    c1 = s3.upload_part_copy(
        Bucket=bucket,
        Key="copied",
        UploadId=up3,
        PartNumber=1,
        CopySource=f"{bucket}/mp",
        CopySourceRange=f"bytes=0-{5 * MiB - 1}",
    )
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key="copied",
        UploadId=up3,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": c1["CopyPartResult"]["ETag"]}]},
    )
    assert s3.get_object(Bucket=bucket, Key="copied")["Body"].read() == p1

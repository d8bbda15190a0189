"""A tenant's QoS limits hold on the S3 gateway too (issue 28): past them,
S3's ``SlowDown`` (503), nothing stored; the limits are shared with /v1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from tests.s3.conftest import Gateway, start_gateway

MiB = 1 << 20
# A limit far below the objects' size: the debt one object leaves takes 8 s to
# pay, so the next one is refused however slow this machine runs the test.
LIMIT = MiB // 8


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Gateway]:
    g = start_gateway(tmp_path, qos_max_wait_ms="0")
    yield g
    g.close()


def _code(e: ClientError) -> tuple[int, str]:
    return e.response["ResponseMetadata"]["HTTPStatusCode"], e.response["Error"]["Code"]


def test_over_its_limits_a_tenant_gets_slowdown_and_nothing_is_stored(gw: Gateway) -> None:
    gw.tenant("lim", "direct", qos={"write_bytes_per_s": LIMIT, "read_bytes_per_s": LIMIT})
    gw.tenant("free", "direct")
    s3, other = gw.client("lim"), gw.client("free")
    s3.create_bucket(Bucket="lim-bucket")
    other.create_bucket(Bucket="free-bucket")
    data = b"x" * MiB
    s3.put_object(Bucket="lim-bucket", Key="one", Body=data)  # a full bucket lets one object through
    with pytest.raises(ClientError) as err:
        s3.put_object(Bucket="lim-bucket", Key="two", Body=data)
    assert _code(err.value) == (503, "SlowDown")
    with pytest.raises(ClientError) as err:
        s3.head_object(Bucket="lim-bucket", Key="two")
    assert _code(err.value)[0] == 404
    for i in range(3):  # another tenant is not held back
        other.put_object(Bucket="free-bucket", Key=f"k{i}", Body=data)
    assert s3.get_object(Bucket="lim-bucket", Key="one")["Body"].read() == data
    with pytest.raises(ClientError) as err:
        s3.get_object(Bucket="lim-bucket", Key="one")
    assert _code(err.value) == (503, "SlowDown")
    doc = gw.admin("GET", "/v1/admin/tenants/lim")
    assert doc["qos"]["write_bytes_per_s"] == LIMIT

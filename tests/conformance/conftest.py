"""A real S3 endpoint for the tier conformance suite: moto's server on
127.0.0.1 on a free port, one bucket per session, dummy credentials."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import pytest
from moto.server import ThreadedMotoServer

REGION = "us-east-1"


class MotoEndpoint:
    """moto's threaded S3 server; ``stop`` also closes the listening socket, so a
    stopped endpoint refuses connections like a dead one, and ``start`` can
    bring it back on the same port (moto keeps its state in the process)."""

    def __init__(self, port: int = 0) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.port = port

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]

    def stop(self) -> None:
        self._server.stop()
        if self._server._server is not None:  # ThreadedMotoServer.stop leaves the socket open
            self._server._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class S3Env:
    endpoint: MotoEndpoint
    bucket: str

    @property
    def url(self) -> str:
        return self.endpoint.url


@pytest.fixture(scope="session")
def aws_env() -> Iterator[None]:
    """Dummy credentials from the standard variables; no metadata service, no
    profile or config file of the machine's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", REGION)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("AWS_CONFIG_FILE", "/dev/null")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(var, raising=False)
        yield


@pytest.fixture(scope="session")
def s3(aws_env: None) -> Iterator[S3Env]:
    endpoint = MotoEndpoint()
    endpoint.start()
    bucket = f"kvstore-test-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint.url, region_name=REGION)
    client.create_bucket(Bucket=bucket)
    client.close()
    try:
        yield S3Env(endpoint, bucket)
    finally:
        endpoint.stop()

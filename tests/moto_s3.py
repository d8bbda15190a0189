"""A real S3 endpoint for tests: moto's S3 server on 127.0.0.1 on a free port
(the fixtures ``aws_env`` and ``s3`` are in tests/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore_bench.moto_s3 import atomic_conditional_puts
from moto.server import ThreadedMotoServer

REGION = "us-east-1"
# What a daemon started by a test needs to reach moto with boto3 (and nothing of the machine's own AWS setup).
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


atomic_conditional_puts()  # (conditional PUTs atomic, as on S3: kvstore_bench/moto_s3.py)


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

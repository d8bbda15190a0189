"""The AWS CLI against the gateway, unchanged: high-level ``s3`` commands
(multipart upload and parallel ranged download of a 40 MiB file, sync,
listing, presign, recursive delete) and ``s3api`` ranged reads.

The CLI pins its own botocore, so it cannot share the project's environment:
it runs when ``aws`` is on PATH or ``KVSTORE_TEST_AWS_CLI`` names the
executable (e.g. from ``python3 -m venv /tmp/cli && /tmp/cli/bin/pip install
awscli``), and is skipped otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.s3.conftest import start_gateway

AWS = os.environ.get("KVSTORE_TEST_AWS_CLI") or shutil.which("aws")
pytestmark = pytest.mark.skipif(
    AWS is None, reason="the AWS CLI is not installed (set KVSTORE_TEST_AWS_CLI to an aws executable)"
)


def test_aws_cli(tmp_path: Path) -> None:
    assert AWS is not None
    (tmp_path / "daemon").mkdir()
    gw = start_gateway(tmp_path / "daemon")
    try:
        akid, secret = gw.tenant("acme", "sealed")
        config = tmp_path / "aws.cfg"
        config.write_text("[default]\ns3 =\n    signature_version = s3v4\n")
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": akid,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(config),
            "AWS_EC2_METADATA_DISABLED": "true",
        }

        def aws(*args: str) -> str:
            done = subprocess.run(
                [AWS, "--endpoint-url", gw.endpoint, *args], env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, (args, done.stdout[-500:], done.stderr[-500:])
            return done.stdout

        big = tmp_path / "big.bin"
        big.write_bytes(os.urandom(40 << 20))
        tree = tmp_path / "tree"
        tree.mkdir()
        for i in range(5):
            (tree / f"f{i}.txt").write_bytes(os.urandom(1000 + i))
        aws("s3", "mb", "s3://clibucket")
        aws("s3", "cp", str(big), "s3://clibucket/big.bin")
        aws("s3", "sync", str(tree), "s3://clibucket/dir/")
        top = aws("s3", "ls", "s3://clibucket/")
        assert "PRE dir/" in top and "big.bin" in top
        assert sorted(line.split()[-1] for line in aws("s3", "ls", "--recursive", "s3://clibucket/").splitlines()) == [
            "big.bin",
            *[f"dir/f{i}.txt" for i in range(5)],
        ]
        aws("s3", "cp", "s3://clibucket/big.bin", str(tmp_path / "back.bin"))
        assert (tmp_path / "back.bin").read_bytes() == big.read_bytes()
        aws(
            "s3api",
            "get-object",
            "--bucket",
            "clibucket",
            "--key",
            "big.bin",
            "--range",
            "bytes=100-199",
            str(tmp_path / "range.bin"),
        )
        assert (tmp_path / "range.bin").read_bytes() == big.read_bytes()[100:200]
        url = aws("s3", "presign", "s3://clibucket/dir/f1.txt").strip()
        with urllib.request.urlopen(url) as r:
            assert r.read() == (tree / "f1.txt").read_bytes()
        aws("s3", "rm", "--recursive", "s3://clibucket/")
        aws("s3", "rb", "s3://clibucket")
    finally:
        gw.close()

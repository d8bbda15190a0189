"""moto's S3 server on 127.0.0.1 for a fleet on one machine: the one
``kvstore-bench fleet`` starts, and the one deploy/fleet/run-local-fleet.sh
runs as ``python -m kvstore_bench.moto_s3``.

A fleet's shared state (its members and tenant registry, kvstore/fleet/) is
changed by conditional PUTs (``If-Match`` / ``If-None-Match: *``), which S3
checks and applies as one step. moto's threaded server checks, then
writes, with no lock between: two nodes racing a change (three joining at
once) can both succeed there and one change is lost. :func:`start`
serializes moto's object PUTs so a fleet on it sees S3's behaviour (the
tests do the same: tests/moto_s3.py).

Usage: ``python -m kvstore_bench.moto_s3 [--port N] [--bucket NAME]
[--url-file PATH]``: serves until SIGTERM or SIGINT, with ``NAME`` created;
prints its URL (and writes it to ``PATH``) once it answers. moto keeps the
objects in memory: they are gone when it stops.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

REGION = "us-east-1"
ACCESS_KEY = "local"  # moto takes any credentials; a daemon still needs some to sign with
SECRET_KEY = "local"


def atomic_conditional_puts() -> None:
    """S3 checks a PUT's ``If-Match`` / ``If-None-Match`` and writes the
    object as one step; moto's threaded server checks, then writes, with no
    lock between, so two racing conditional PUTs can both succeed there.
    The fleet's shared state (kvstore/fleet/) relies on S3's behaviour:
    serialize moto's object PUTs (in this process) so that it holds. The
    tests' S3 server (tests/moto_s3.py) and this one both call it."""
    from moto.s3.responses import S3Response

    if getattr(S3Response.put_object, "_kvstore_atomic", False):
        return
    lock = threading.Lock()
    original = S3Response.put_object

    @functools.wraps(original)
    def put_object(self: Any) -> Any:
        with lock:
            return original(self)

    put_object._kvstore_atomic = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign]


def start(port: int = 0, host: str = "127.0.0.1") -> tuple[Any, str]:
    """moto's threaded server, started: (the server, its URL). ``port`` 0: a free one."""
    from moto.server import ThreadedMotoServer

    atomic_conditional_puts()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    got_host, got_port = server.get_host_and_port()
    return server, f"http://{got_host}:{got_port}"


def ensure_bucket(url: str, bucket: str, local: bool = True) -> bool:
    """Create ``bucket`` at ``url`` unless it exists; True if it was created.
    ``local``: moto's (any credentials do), else with the environment's
    (``AWS_ACCESS_KEY_ID``..., as the daemons take them)."""
    import boto3
    from botocore.exceptions import ClientError

    keys = {"aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY} if local else {}
    s3 = boto3.client("s3", endpoint_url=url, region_name=REGION if local else None, **keys)
    try:
        s3.head_bucket(Bucket=bucket)
        return False
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
    s3.create_bucket(Bucket=bucket)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore_bench.moto_s3", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0, help="the port to listen on (default 0: a free one)")
    p.add_argument("--bucket", default="", help="a bucket to create (none by default)")
    p.add_argument("--url-file", type=Path, help="also write the server's URL to this file once it answers")
    p.add_argument(
        "--endpoint",
        default="",
        help="serve nothing: create --bucket at this S3 endpoint if absent (the environment's AWS credentials)",
    )
    a = p.parse_args(argv)
    if a.endpoint:
        if not a.bucket:
            p.error("--endpoint needs --bucket")
        created = ensure_bucket(a.endpoint, a.bucket, local=False)
        print(f"bucket {a.bucket!r} {'created' if created else 'exists'} at {a.endpoint}", flush=True)
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server, url = start(a.port)
    try:
        if a.bucket:
            ensure_bucket(url, a.bucket)
        if a.url_file:
            tmp = a.url_file.with_name(a.url_file.name + ".tmp")
            tmp.write_text(url + "\n")
            tmp.replace(a.url_file)
        print(url, flush=True)
        while not stop.wait(0.5):  # (woken by the signal handler)
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

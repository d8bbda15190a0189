"""A tier in an S3 bucket (AWS or any S3-compatible endpoint) through boto3.

boto3 is blocking: every call runs in this tier's own bounded thread pool, so
at most ``max_concurrency`` requests are in flight per tier (plus the part
uploads of a multipart ``put_file``, bounded by ``part_concurrency``). botocore
retries connection errors, 5xx and throttling itself (standard mode, with
backoff and jitter, ``max_attempts`` in all); what is left after that is mapped
by :func:`_map_error`, the one place where boto errors become tier errors.

Objects live under ``prefix`` (normalized to end with ``/``), so tiers with
different prefixes share a bucket without seeing each other.
"""

from __future__ import annotations

import asyncio
import builtins
import io
import os
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)

from kvstore.errors import (
    BucketNotFound,
    TierAccessDenied,
    TierConflict,
    TierError,
    TierNoCredentials,
    TierNotFound,
    TierRangeError,
    TierUnavailable,
)
from kvstore.tier.base import ObjectInfo, check_range, source_size, validate_object_name, validate_prefix

MiB = 1 << 20
T = TypeVar("T")

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
# The credentials or their rights refused (a 401 or 403 that is not one of the throttles below).
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidSecurity",
        "403",
    }
)
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "ProvisionedThroughputExceededException",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "ServiceUnavailable",
        "InternalError",
    }
)


# botocore's names for where credentials came from (Credentials.method).
_CREDENTIAL_SOURCES = {
    "explicit": "the tier's settings",
    "env": "the environment (AWS_ACCESS_KEY_ID)",
    "shared-credentials-file": "the shared credentials file (AWS_SHARED_CREDENTIALS_FILE, ~/.aws/credentials)",
    "config-file": "the AWS config file (AWS_CONFIG_FILE, ~/.aws/config)",
    "iam-role": "the instance's role (EC2 metadata)",
    "container-role": "the container's role (ECS/EKS)",
    "assume-role": "an assumed role (AWS_PROFILE's role_arn)",
    "assume-role-with-web-identity": "a web identity (AWS_WEB_IDENTITY_TOKEN_FILE)",
    "sso": "AWS SSO (AWS_PROFILE)",
    "custom-process": "a credential_process (AWS_PROFILE)",
}


class S3Tier:
    """:class:`~kvstore.tier.base.Tier` over ``s3://bucket/prefix``.

    Credentials are ``access_key_id``/``secret_access_key`` (and
    ``session_token``) when given, else boto3's standard chain
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
    ``AWS_PROFILE``, instance roles). ``path_style`` addresses the bucket as
    ``endpoint/bucket/key``, which most S3-compatible stores need.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        path_style: bool = False,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        max_concurrency: int = 16,
        part_concurrency: int = 4,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
        max_attempts: int = 5,
        read_max_attempts: int = 2,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        range_read_timeout: float = 10.0,
        list_page_size: int = 1000,
    ) -> None:
        if not bucket:
            raise TierError("S3 tier: the bucket name is empty")
        if min(max_concurrency, part_concurrency, max_attempts, read_max_attempts) < 1:
            raise TierError(
                "S3 tier: max_concurrency, part_concurrency, max_attempts and read_max_attempts must be >= 1"
            )
        if part_size < 5 * MiB or multipart_threshold < 5 * MiB:
            raise TierError("S3 tier: part_size and multipart_threshold must be >= 5 MiB (S3's smallest part)")
        if not 1 <= list_page_size <= 1000:
            raise TierError("S3 tier: list_page_size must be 1..1000")
        prefix = prefix.strip("/")
        if prefix:
            validate_prefix(prefix)
            prefix += "/"
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self._page_size = list_page_size
        config = Config(
            region_name=region,
            retries={"mode": "standard", "total_max_attempts": max_attempts},  # the first try included
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # Every pool thread and every part upload can hold a connection.
            max_pool_connections=max_concurrency * (1 + part_concurrency),
            s3={"addressing_style": "path"} if path_style else None,
        )
        session = boto3.session.Session(
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            aws_session_token=session_token,
            region_name=region,
        )
        self._session = session
        self._client: Any = session.client("s3", endpoint_url=endpoint_url, config=config)
        # Ranged reads serve a waiting request: fewer attempts, so a dead
        # endpoint fails the read fast (the caller's retry policy decides).
        self._read_client: Any = session.client(
            "s3",
            endpoint_url=endpoint_url,
            config=config.merge(
                Config(
                    retries={"mode": "standard", "total_max_attempts": read_max_attempts},
                    read_timeout=range_read_timeout,
                )
            ),
        )
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=part_size,
            max_concurrency=part_concurrency,
            use_threads=True,
        )
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="kvstore-s3")

    def credential_source(self) -> str:
        """Where the credentials this tier signs with come from, in words (no
        secret, no key id): for an operator told that access was denied."""
        creds = self._session.get_credentials()
        if creds is None:
            return "no credentials"
        method = str(getattr(creds, "method", "") or "unknown")
        return f"credentials from {_CREDENTIAL_SOURCES.get(method, method)}"

    def __repr__(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"S3Tier(s3://{self.bucket}/{self.prefix}{where})"

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _key(self, name: str) -> str:
        return self.prefix + validate_object_name(name)

    # -- writes ------------------------------------------------------------------

    async def put_file(self, name: str, path: Path) -> None:
        key = self._key(name)
        source_size(path)

        def upload() -> None:
            with _map_error(name):
                self._client.upload_file(os.fspath(path), self.bucket, key, Config=self._transfer)

        await self._run(upload)

    async def put_bytes(self, name: str, data: bytes) -> None:
        key = self._key(name)

        def put() -> None:
            with _map_error(name):
                if len(data) >= self._transfer.multipart_threshold:
                    self._client.upload_fileobj(io.BytesIO(data), self.bucket, key, Config=self._transfer)
                else:
                    self._client.put_object(Bucket=self.bucket, Key=key, Body=data)

        await self._run(put)

    async def put_if(self, name: str, data: bytes, etag: str | None) -> str:
        key = self._key(name)
        cond = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": f'"{etag}"'}

        def put() -> str:
            with _map_error(name):
                try:
                    resp = self._client.put_object(Bucket=self.bucket, Key=key, Body=data, **cond)
                except ClientError as e:
                    if _absent(e):  # If-Match, and the object went
                        raise TierConflict(f"conditional write of {name!r}: the object is gone") from e
                    raise
                return str(resp.get("ETag", "")).strip('"')

        return await self._run(put)

    async def get(self, name: str) -> tuple[bytes, str] | None:
        key = self._key(name)

        def get() -> tuple[bytes, str] | None:
            with _map_error(name):
                try:
                    resp = self._client.get_object(Bucket=self.bucket, Key=key)
                except ClientError as e:
                    if _absent(e):
                        return None
                    raise
                body = resp["Body"]
                try:
                    data: bytes = body.read()
                finally:
                    body.close()
                return data, str(resp.get("ETag", "")).strip('"')

        return await self._run(get)

    async def delete(self, name: str) -> None:
        key = self._key(name)

        def delete() -> None:
            with _map_error(name):
                try:
                    self._client.delete_object(Bucket=self.bucket, Key=key)
                except ClientError as e:
                    if _error_code(e) not in _NOT_FOUND_CODES:
                        raise

        await self._run(delete)

    # -- reads -------------------------------------------------------------------

    async def read_range(self, name: str, start: int, length: int) -> bytes:
        key = self._key(name)
        check_range(name, start, length)
        if length == 0:  # S3 has no empty range: check the bounds with a HEAD
            info = await self.head(name)
            if info is None:
                raise TierNotFound(f"no object {name!r} in s3://{self.bucket}/{self.prefix}")
            if start > info.size:
                raise TierRangeError(f"range {start}+0 of {name!r} starts past its size {info.size}", info.size)
            return b""

        def get() -> bytes:
            with _map_error(name):
                try:
                    rng = f"bytes={start}-{start + length - 1}"
                    resp = self._read_client.get_object(Bucket=self.bucket, Key=key, Range=rng)
                except ClientError as e:
                    if _error_code(e) != "InvalidRange" and _status(e) != 416:
                        raise
                    size = self._size_or_unknown(key)
                    raise TierRangeError(f"range {start}+{length} of {name!r} starts past its size {size}", size) from e
                body = resp["Body"]
                try:
                    data: bytes = body.read()
                finally:
                    body.close()
                if len(data) != length:
                    # S3 cuts a range that ends past the object to what is there.
                    size = _total_from_content_range(resp.get("ContentRange"))
                    raise TierRangeError(f"range {start}+{length} of {name!r} ends past its size {size}", size)
                return data

        return await self._run(get)

    def _size_or_unknown(self, key: str) -> int:
        try:
            return int(self._client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except (ClientError, BotoCoreError):
            return -1

    async def head(self, name: str) -> ObjectInfo | None:
        key = self._key(name)

        def head() -> ObjectInfo | None:
            with _map_error(name):
                try:
                    resp = self._client.head_object(Bucket=self.bucket, Key=key)
                except ClientError as e:
                    if _absent(e):
                        return None
                    raise
                return ObjectInfo(name, int(resp["ContentLength"]), str(resp.get("ETag", "")).strip('"'))

        return await self._run(head)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        validate_prefix(prefix)
        paginator = self._client.get_paginator("list_objects_v2")
        pages: Iterator[dict[str, Any]] = iter(
            paginator.paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix, PaginationConfig={"PageSize": self._page_size}
            )
        )

        def next_page() -> dict[str, Any] | None:
            with _map_error(prefix or "/"):
                return next(pages, None)

        while (page := await self._run(next_page)) is not None:
            for obj in page.get("Contents", ()):
                yield ObjectInfo(obj["Key"][len(self.prefix) :], int(obj["Size"]), str(obj.get("ETag", "")).strip('"'))

    async def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()
        self._read_client.close()


def _total_from_content_range(value: object) -> int:
    # "bytes 0-99/1234" -> 1234
    if isinstance(value, str) and "/" in value:
        total = value.rpartition("/")[2]
        if total.isdigit():
            return int(total)
    return -1


def _error_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _root_cause(e: BaseException) -> BaseException:
    # boto3's managed transfers re-raise a ClientError as S3UploadFailedError
    # inside the except block: the original is the context.
    seen: builtins.list[BaseException] = []
    while isinstance(e, S3UploadFailedError) and e not in seen:
        seen.append(e)
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            break
        e = nxt
    return e


def _absent(e: ClientError) -> bool:
    """The object is not there (a 404), its bucket is (a missing bucket is
    S3's 404 too, with the code NoSuchBucket: an error, not an absence;
    a HEAD's 404 carries no code and cannot tell them apart)."""
    code = _error_code(e)
    return code != "NoSuchBucket" and (code in _NOT_FOUND_CODES or _status(e) == 404)


@contextmanager
def _map_error(name: str) -> Iterator[None]:
    """The one place where boto3/botocore errors become tier errors."""
    try:
        yield
    except TierError:
        raise
    except (ClientError, BotoCoreError, S3UploadFailedError, OSError) as raised:
        e = _root_cause(raised)
        if isinstance(e, ClientError):
            code, status = _error_code(e), _status(e)
            what = f"S3 {e.operation_name} of {name!r}: {code or status}"
            if code == "NoSuchBucket":
                raise BucketNotFound(f"{what}: the bucket does not exist") from raised
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                # (S3 answers 409 when another conditional write of the key is in flight)
                raise TierConflict(f"{what}: the object changed since it was read") from raised
            if code in _NOT_FOUND_CODES or status == 404:
                raise TierNotFound(f"{what}: no such object") from raised
            if code in _THROTTLE_CODES or status == 429 or status >= 500:
                raise TierUnavailable(f"{what} (HTTP {status}), after retries") from raised
            if code in _DENIED_CODES or status in (401, 403):
                raise TierAccessDenied(f"{what} (HTTP {status}): access denied") from raised
            raise TierError(f"{what} (HTTP {status})") from raised
        if isinstance(e, NoCredentialsError | PartialCredentialsError):
            raise TierNoCredentials(f"S3 request for {name!r}: {e}") from raised
        if isinstance(e, ConnectionError | HTTPClientError | IncompleteReadError):
            raise TierUnavailable(f"S3 endpoint unreachable for {name!r}: {e}") from raised
        if isinstance(e, BotoCoreError):
            raise TierError(f"S3 client error for {name!r}: {e}") from raised
        if isinstance(e, OSError):
            raise TierError(f"S3 upload of {name!r}: {e}") from raised
        raise TierError(f"S3 upload of {name!r} failed: {e}") from raised

"""S3's errors: a code from S3's documented list, its status, and a message.

:class:`S3Error` is a :class:`kvstore.errors.KVStoreError` (one error tree);
the gateway answers it as S3's XML error document. :func:`from_kvstore`
translates the store's own errors.
"""

from __future__ import annotations

from kvstore.buckets.catalog import NoSuchUpload
from kvstore.errors import (
    BlockTooLarge,
    InvalidInput,
    KVStoreError,
    NotFound,
    Overloaded,
    QuotaExceeded,
    ReadOnlyNode,
    ReadOnlyStore,
    RequestTimeout,
    StorageFull,
)
from kvstore.transport.statuses import http_status

# S3's status for each error code the gateway answers
# (https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html).
STATUS: dict[str, int] = {
    "AccessDenied": 403,
    "AuthorizationHeaderMalformed": 400,
    "AuthorizationQueryParametersError": 400,
    "BadDigest": 400,
    "BucketAlreadyExists": 409,
    "BucketAlreadyOwnedByYou": 409,
    "BucketNotEmpty": 409,
    "EntityTooLarge": 400,
    "EntityTooSmall": 400,
    "IncompleteBody": 400,
    "InternalError": 500,
    "InvalidAccessKeyId": 403,
    "IllegalLocationConstraintException": 400,
    "InvalidArgument": 400,
    "InvalidBucketName": 400,
    "InvalidDigest": 400,
    "InvalidPart": 400,
    "InvalidPartOrder": 400,
    "InvalidPartNumber": 416,
    "InvalidRange": 416,
    "InvalidRequest": 400,
    "KeyTooLongError": 400,
    "MalformedXML": 400,
    "MethodNotAllowed": 405,
    "MissingContentLength": 411,
    "NoSuchBucket": 404,
    "NoSuchKey": 404,
    "NoSuchUpload": 404,
    "NotImplemented": 501,
    "PreconditionFailed": 412,
    "RequestTimeTooSkewed": 403,
    "RequestTimeout": 400,
    "ServiceUnavailable": 503,
    "SignatureDoesNotMatch": 403,
    "SlowDown": 503,
    "XAmzContentSHA256Mismatch": 400,
    "InvalidChunkSizeError": 403,
}


class S3Error(KVStoreError):
    """An error answered as S3's XML ``<Error>`` document."""

    def __init__(self, s3_code: str, message: str, **extra: str) -> None:
        super().__init__(message)
        self.s3_code = s3_code
        self.status = STATUS[s3_code]
        self.code = "s3_" + s3_code
        self.message = message
        self.extra = extra  # more elements of the <Error> document (Region, Key, BucketName…)
        self.retryable = self.status >= 500


def from_kvstore(e: KVStoreError) -> S3Error:
    """The S3 error a client sees for one of the store's errors."""
    if isinstance(e, S3Error):
        return e
    if isinstance(e, QuotaExceeded | StorageFull):
        return S3Error("EntityTooLarge" if isinstance(e, QuotaExceeded) else "ServiceUnavailable", str(e))
    if isinstance(e, BlockTooLarge):
        return S3Error("EntityTooLarge", str(e))
    if isinstance(e, Overloaded):
        return S3Error("SlowDown", str(e))
    if isinstance(e, ReadOnlyStore | ReadOnlyNode):
        return S3Error("AccessDenied", str(e))
    if isinstance(e, RequestTimeout):
        return S3Error("RequestTimeout", str(e))
    if isinstance(e, NoSuchUpload):
        return S3Error("NoSuchUpload", "The specified upload does not exist.")
    if isinstance(e, NotFound):
        return S3Error("NoSuchKey", "The specified key does not exist.")
    if isinstance(e, InvalidInput):
        return S3Error("InvalidArgument", str(e))
    if http_status(e) == 503 or e.retryable:
        return S3Error("ServiceUnavailable", str(e))
    return S3Error("InternalError", "We encountered an internal error. Please try again.")

"""The HTTP status of each engine error: the transports' mapping, in one place.

Engine errors carry a stable code and whether a retry can help
(kvstore/errors.py); what the daemon answers over HTTP (the /v1 API, the
internal relays, the batch and NIXL result items, which use HTTP statuses
too) is decided here. The S3 gateway maps the same errors to S3's codes in
s3/errors.py. A subclass answers as its nearest mapped base; anything
unmapped is a 500.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import (
    AgentTaken,
    AgentUnknown,
    BlockTooLarge,
    BodyTooLarge,
    CorruptionError,
    ExpectationFailed,
    Fenced,
    FleetOff,
    FlushIncomplete,
    InsecureTransport,
    InvalidInput,
    InvalidRange,
    KeyReserved,
    KVStoreError,
    LengthRequired,
    Misdirected,
    NixlDisabled,
    NodeAlive,
    NotAdmitted,
    NotFound,
    NotPlannable,
    Overloaded,
    PathsNotOffered,
    QuotaExceeded,
    RateLimited,
    ReadOnlyNode,
    ReadOnlyStore,
    RecordRejected,
    RequestTimeout,
    SegmentMoved,
    StorageFull,
    StorageIOError,
    StoreClosed,
    StoreLocked,
    TenantExists,
    TenantKeyDestroyed,
    TierNotFound,
    TierUnavailable,
    TransferFailed,
    Unauthorized,
    UnixSocketRequired,
    UnsupportedMediaType,
    WriterTimeout,
    WrittenBytesMismatch,
)

STATUS: dict[type[KVStoreError], int] = {
    NotAdmitted: 202,  # a decision, not a failure: nothing stored, no ETag
    InvalidInput: 400,
    InvalidRange: 416,
    Misdirected: 421,
    BlockTooLarge: 413,
    NotFound: 404,
    TenantExists: 409,
    NotPlannable: 409,
    UnixSocketRequired: 400,
    PathsNotOffered: 400,
    InsecureTransport: 403,
    NixlDisabled: 404,
    AgentUnknown: 409,
    AgentTaken: 409,
    TransferFailed: 502,
    StoreLocked: 503,
    StoreClosed: 503,
    ReadOnlyStore: 503,
    StorageFull: 507,
    ReadOnlyNode: 403,
    Fenced: 503,
    FleetOff: 404,
    NodeAlive: 409,
    FlushIncomplete: 503,
    StorageIOError: 503,
    CorruptionError: 500,
    TenantKeyDestroyed: 404,
    Unauthorized: 401,
    LengthRequired: 411,
    RequestTimeout: 408,
    Overloaded: 503,
    RateLimited: 429,
    ExpectationFailed: 417,
    WriterTimeout: 504,
    BodyTooLarge: 413,
    UnsupportedMediaType: 415,
    TierUnavailable: 503,
    TierNotFound: 404,
    SegmentMoved: 503,
    QuotaExceeded: 507,
    KeyReserved: 503,
    WrittenBytesMismatch: 422,
    RecordRejected: 422,
}


def http_status(e: KVStoreError) -> int:
    """The HTTP status that answers ``e``."""
    for cls in type(e).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status
    return 500


def item_answer(key: str, e: KVStoreError) -> dict[str, Any]:
    """A batch, write-plan or NIXL item whose block was not stored: its
    status and the error (a block not admitted: the ``202`` and its offers,
    as ``PUT /v1/blocks/{key}`` answers them)."""
    if isinstance(e, NotAdmitted):
        return {"key": key, "status": http_status(e), **e.answer()}
    answer = {"key": key, "status": http_status(e), "error": {"code": e.code, "message": str(e)}}
    if isinstance(e, Misdirected):
        answer["owner"] = e.owner  # where the fleet places the key (421)
    return answer

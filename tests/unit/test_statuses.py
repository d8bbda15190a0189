"""Engine errors carry a code and whether a retry helps; their HTTP status is
the transports' (kvstore/transport/statuses.py, issue 25). Regression: 32 of
47 engine errors carried an HTTP status, an internal retry signal
(SegmentMoved) among them."""

from __future__ import annotations

import inspect

import kvstore.errors
from kvstore.errors import (
    CorruptionError,
    InvalidKey,
    KVStoreError,
    NotAdmitted,
    NotFound,
    StorageFull,
    TenantNotFound,
)
from kvstore.transport.statuses import STATUS, http_status


def _error_classes() -> list[type[KVStoreError]]:
    return [c for _, c in inspect.getmembers(kvstore.errors, inspect.isclass) if issubclass(c, KVStoreError)]


def test_engine_errors_carry_no_http_status() -> None:
    for cls in _error_classes():
        assert "status" not in vars(cls), f"{cls.__name__} carries an HTTP status"
        assert isinstance(cls.code, str) and cls.code and isinstance(cls.retryable, bool)


def test_every_error_maps_to_a_status_as_its_nearest_base() -> None:
    for cls in _error_classes():
        status = http_status(cls.__new__(cls))
        # NotAdmitted is a decision, not a failure (nothing stored; issue 41): 202.
        assert 400 <= status <= 599 or (cls is NotAdmitted and status == 202), cls
    assert http_status(InvalidKey("x")) == 400  # InvalidInput's
    assert http_status(TenantNotFound("x")) == 404  # NotFound's
    assert http_status(StorageFull("x")) == 507
    assert http_status(CorruptionError("x")) == 500
    assert http_status(KVStoreError("x")) == 500
    assert all(issubclass(c, KVStoreError) for c in STATUS) and NotFound in STATUS

"""Errors raised in strict mode (``AsyncClient(strict=True)``).

In the default, fail-open mode none of these reach the caller: a failed call
returns a miss (``None``, ``False``, ``0``) and is counted in ``client.stats``.
"""

from __future__ import annotations


class KVStoreClientError(Exception):
    """Base class. ``status`` is the HTTP status (None when no answer came),
    ``code`` the server's stable error code (or a client-side one), ``endpoint``
    the server that failed (None for client-side errors)."""

    code: str = "client_error"
    retryable: bool = False
    #: seconds the server asked the client to wait before a retry (its Retry-After), if it said
    retry_after: float | None = None
    #: whether this failure counts against the endpoint's circuit breaker
    breaker_failure: bool = False

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        endpoint: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        if code is not None:
            self.code = code
        self.endpoint = endpoint
        if retryable is not None:
            self.retryable = retryable

    def __str__(self) -> str:
        where = f" [{self.endpoint}]" if self.endpoint else ""
        status = f"{self.status} " if self.status is not None else ""
        return f"{status}{self.code}: {self.message}{where}"


class ServerError(KVStoreClientError):
    """The server answered with an error status; ``code`` comes from its JSON body."""

    #: a fleet node's ``421 misdirected`` (a write of a key it does not own): the owner's URL
    owner: str | None = None


class UnavailableError(KVStoreClientError):
    """No usable answer: connection refused or reset, or a retryable status after the last retry."""

    code = "unavailable"
    retryable = True
    breaker_failure = True


class CircuitOpenError(UnavailableError):
    """The endpoint's circuit breaker is open: the call was not sent."""

    code = "circuit_open"
    retryable = False
    breaker_failure = False


class DeadlineExceeded(KVStoreClientError, TimeoutError):
    """The call's deadline (``timeout``) passed."""

    code = "deadline_exceeded"
    breaker_failure = True


class ProtocolError(KVStoreClientError):
    """The server's answer could not be understood (bad batch framing, bad JSON)."""

    code = "protocol_error"
    breaker_failure = True


class CorruptBlock(KVStoreClientError):
    """A block the client checked itself (a read plan's bytes, a record it
    decoded) fails its checksum or its GCM tag, or is not the block asked
    for: never returned as bytes."""

    code = "corruption"


class BufferTooSmall(KVStoreClientError):
    """``get_into``: the block is larger than the buffer."""

    code = "buffer_too_small"


class InvalidKeyError(KVStoreClientError, ValueError):
    """A key outside the grammar ``[A-Za-z0-9._~:@=+-]{1,256}`` (checked before sending)."""

    code = "invalid_key"

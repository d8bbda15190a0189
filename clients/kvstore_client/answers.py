"""A daemon's answers read: its statuses and JSON error bodies, as client errors.

Which statuses are worth a retry (:data:`RETRYABLE_STATUSES`) and which count
against an endpoint's circuit breaker (:data:`BREAKER_STATUSES`) are decided
here, once. A 404 is not an error: it is :class:`Miss`, which the caller
turns into ``None`` (or ``False``), and tries the key's next owner. Nor is
a put's ``202`` (:data:`NOT_ADMITTED`): the tenant's admission declined the
block, nothing was stored, and a retry would only count another offer.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from kvstore_client.errors import ProtocolError, ServerError
from kvstore_client.wire.headers import OWNER

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504, 507})
MISDIRECTED = 421  # a write to a fleet node that does not own the key: the fleet client follows Kvstore-Owner
BREAKER_STATUSES = frozenset({502, 503, 504})
MAX_RETRY_AFTER_S = 3600  # a larger Retry-After is read as this (the call's deadline bounds it anyway)
NOT_ADMITTED = 202  # a put its tenant's admission (admit_after) declined: not stored, not a failure
_PUT_RANK = {201: 3, 200: 2, NOT_ADMITTED: 1}
PUT_RESULTS = frozenset(_PUT_RANK)


def best(old: int | None, new: int) -> int:
    """The better of two results of one block's put (replicas, transports):
    201 (stored now) over 200 (there already) over 202 (not admitted)."""
    return new if old is None or _PUT_RANK[new] > _PUT_RANK[old] else old


class Miss(Exception):
    """Internal: an endpoint definitively does not have the key (404)."""


async def json_answer(r: aiohttp.ClientResponse) -> dict[str, Any]:
    """The answer's body as a JSON object, else ProtocolError."""
    try:
        doc = json.loads(await r.read())
    except ValueError as e:
        raise ProtocolError(f"bad JSON answer: {e}", status=r.status) from None
    if not isinstance(doc, dict):
        raise ProtocolError("JSON answer is not an object", status=r.status)
    return doc


def error_from(status: int, body: bytes, r: aiohttp.ClientResponse | None = None) -> ServerError:
    """The daemon's error answer (``{"error": {"code", "message"}}``, or
    anything else, e.g. a proxy's HTML) as a ServerError."""
    code, message = f"http_{status}", (r.reason if r is not None and r.reason else "")
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict):
            code = str(err.get("code", code))
            message = str(err.get("message", message))
    err = ServerError(
        message or f"HTTP {status}",
        status=status,
        code=code,
        retryable=status in RETRYABLE_STATUSES,
    )
    if r is not None:
        err.retry_after = retry_after(r.headers.get("Retry-After"))
        err.owner = r.headers.get(OWNER)
    return err


def retry_after(value: str | None) -> float | None:
    """A Retry-After header's delay in seconds (RFC 9110 §10.2.3: delta-seconds;
    an HTTP-date or anything else is not used: None)."""
    if value is None or not value.strip().isdigit():
        return None
    return float(min(int(value.strip()), MAX_RETRY_AFTER_S))


async def check(r: aiohttp.ClientResponse, ok: tuple[int, ...]) -> None:
    """Return if ``r.status`` is in ``ok``; raise Miss on 404, else the server's error."""
    if r.status in ok:
        return
    if r.status == 404:
        raise Miss
    body = await r.read() if r.method != "HEAD" else b""
    err = error_from(r.status, body, r)
    # A server that says when to come back (Retry-After: overloaded, rate
    # limited) is pacing its clients, not failing: its breaker stays closed.
    err.breaker_failure = r.status in BREAKER_STATUSES and err.retry_after is None
    raise err

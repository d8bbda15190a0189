"""Who is asking: the bearer token names a tenant, or is the admin's."""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from kvstore.errors import Unauthorized
from kvstore.transport.http.appkeys import TENANT, config_of, store_of


def _bearer(request: web.Request) -> str:
    return bearer(request.headers.get("Authorization", ""))


def bearer(header: str) -> str:
    """The token of an ``Authorization`` field's value, or Unauthorized
    saying what is wrong: the one reading of it, for the routes and the
    fast lane alike."""
    scheme, _, token = header.partition(" ")
    token = token.strip(" \t")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    # Tokens are visible ASCII (RFC 6750's b64token is a subset); anything else
    # cannot name a tenant. Never echo it: it may be a secret with a typo.
    if not token.isascii() or not token.isprintable() or " " in token:
        raise Unauthorized("malformed bearer token: expected visible ASCII characters")
    return token


def tenant_of(request: web.Request) -> str:
    """The tenant named by the request's bearer token (401 when none)."""
    cached: str | None = request.get(TENANT)
    if cached is not None:
        return cached
    tenant = store_of(request).authenticate(_bearer(request))
    if tenant is None:
        raise Unauthorized("unknown or revoked token")
    request[TENANT] = tenant
    return tenant


def is_bearer_unknown(request: web.Request) -> bool:
    """Whether the request carries a well-formed bearer token that names no
    tenant here (not a missing or malformed one, nor the admin's)."""
    try:
        token = _bearer(request)
    except Unauthorized:
        return False
    return store_of(request).authenticate(token) is None and not _matches(token, config_of(request).admin_secret())


def known_tenant(request: web.Request) -> str | None:
    """The tenant the request's token named, once checked (None: not yet, or an admin call)."""
    return request.get(TENANT)


def require_admin(request: web.Request) -> None:
    if not _matches(_bearer(request), config_of(request).admin_secret()):
        raise Unauthorized("admin token required")


def require_metrics_token(request: web.Request) -> None:
    """``/metrics``'s token, where ``metrics_token`` is set (the admin token works too)."""
    secret = config_of(request).metrics_secret()
    if secret is None:
        return
    token = _bearer(request)
    if not (_matches(token, secret) | _matches(token, config_of(request).admin_secret())):  # (both compared)
        raise Unauthorized("metrics token required (metrics_token)")


def is_admin(request: web.Request) -> bool:
    """Whether the request carries the admin token (never raises)."""
    try:
        require_admin(request)
    except Unauthorized:
        return False
    return True


def _matches(token: str, secret: str | None) -> bool:
    """Whether ``token`` is ``secret``: fixed-length digests compared in
    constant time (no early exit, no length leak)."""
    return secret is not None and hmac.compare_digest(_digest(token), _digest(secret))


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()

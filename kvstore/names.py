"""Validation of the names clients choose: block keys and tenant names."""

from __future__ import annotations

import re

from kvstore_client.wire.keys import all_keys_valid as all_keys_valid
from kvstore_client.wire.keys import key_problem

from kvstore.errors import InvalidInput, InvalidKey, InvalidTenant

TENANT_MAX_LEN = 64

# Tenant names become directory names: no leading dot, no path separators.
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,63}")


def validate_key(key: object) -> str:
    """Return ``key`` if it is 1-256 characters of ``[A-Za-z0-9._~:@=+-]``
    (the grammar both sides apply: kvstore_client/wire/keys.py)."""
    problem = key_problem(key)
    if problem is None and isinstance(key, str):
        return key
    raise InvalidKey(problem)


# Keys under these prefixes are the S3 gateway's: its objects' bytes and its
# records of buckets, objects and uploads (kvstore/buckets/objects.py, records.py).
# Clients cannot write or delete them through /v1 or NIXL, so nothing a tenant
# writes there can pass for the gateway's state when it is rebuilt.
S3_DATA_PREFIX = "s3~"
S3_RECORD_PREFIX = "s3m~"
GATEWAY_PREFIXES = (S3_DATA_PREFIX, S3_RECORD_PREFIX)


def validate_client_key(key: object) -> str:
    """:func:`validate_key` for a key a client writes or deletes directly:
    not under the S3 gateway's prefixes."""
    validate_key(key)
    assert isinstance(key, str)
    if key.startswith(GATEWAY_PREFIXES):
        prefix = next(p for p in GATEWAY_PREFIXES if key.startswith(p))
        raise InvalidKey(f"keys starting with {prefix!r} are the S3 gateway's; use it to write or delete them")
    return key


def validate_tenant(name: object) -> str:
    """Return ``name`` if it is a valid tenant name (1-64 chars, no leading dot)."""
    if not isinstance(name, str):
        raise InvalidTenant(f"tenant name must be a string, got {type(name).__name__}")
    if _TENANT_RE.fullmatch(name) is None:
        raise InvalidTenant(
            f"tenant name {name[:80]!r} is invalid; expected 1-64 characters of "
            "[A-Za-z0-9._-] starting with a letter or digit"
        )
    return name


_HEX_RE = re.compile(r"[0-9a-f]+")


def _hex_id(value: object, digits: int, what: str) -> str:
    """Return ``value`` if it is ``digits`` lowercase hex digits."""
    if not isinstance(value, str) or len(value) != digits or _HEX_RE.fullmatch(value) is None:
        shown = value[:40] if isinstance(value, str) else type(value).__name__
        raise InvalidInput(f"{what} {shown!r} is invalid; expected {digits} lowercase hex digits")
    return value


def validate_token_id(token_id: object) -> str:
    """Return ``token_id`` if it has the form of a token id (16 hex digits)."""
    return _hex_id(token_id, 16, "token id")


def validate_lease(lease: object) -> str:
    """Return ``lease`` if it has the form of a lease id (32 hex digits)."""
    return _hex_id(lease, 32, "lease")


def validate_plan_id(plan: object) -> str:
    """Return ``plan`` if it has the form of a write plan id (32 hex digits)."""
    return _hex_id(plan, 32, "write plan")


_ACCESS_KEY_RE = re.compile(r"[A-Z0-9]{16,64}")


def validate_access_key_id(value: object) -> str:
    """Return ``value`` if it has the form of an S3 access key id (16-64 of A-Z 0-9)."""
    if not isinstance(value, str) or _ACCESS_KEY_RE.fullmatch(value) is None:
        shown = value[:40] if isinstance(value, str) else type(value).__name__
        raise InvalidInput(f"access key id {shown!r} is invalid; expected 16-64 characters of A-Z 0-9")
    return value


NODE_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")  # a fleet node's id (kvstore/fleet/)


def validate_node_id(value: object) -> str:
    """Return ``value`` if it is a fleet node's id: 1-64 of [a-z0-9-], starting with a letter or digit."""
    if not isinstance(value, str) or NODE_ID.fullmatch(value) is None:
        shown = value[:40] if isinstance(value, str) else type(value).__name__
        raise InvalidInput(f"node id {shown!r} is invalid; expected 1-64 characters of [a-z0-9-]")
    return value


# Every path parameter of every route, and how it is checked. Every worker
# checks the decoded parameters with these before it answers or relays a
# request, so a route means the same on every worker.
PATH_PARAMS = {
    "key": validate_key,
    "name": validate_tenant,
    "token_id": validate_token_id,
    "lease": validate_lease,
    "plan": validate_plan_id,
    "access_key_id": validate_access_key_id,
    "node_id": validate_node_id,
}

"""A tenant's QoS: its weight under contention and its node-wide limits.

``weight`` (1..1000, default 100) is its share of a busy worker's bulk
transfers against the other tenants' weights (fair.py); the limits (bytes per
second of reads and of writes, requests per second; 0: none) hold whatever
else is running (buckets.py). The registry keeps what was set on the tenant
(POST and PATCH ``/v1/admin/tenants``); a field never set, or set to null,
follows the store-wide default (the ``default_qos_*`` settings).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvstore.errors import InvalidInput

MAX_WEIGHT = 1000
DEFAULT_WEIGHT = 100
MAX_RATE = 1 << 50  # bytes or requests per second: far past any machine, well inside a float's exact range
QOS_FIELDS = ("weight", "read_bytes_per_s", "write_bytes_per_s", "requests_per_s")


@dataclass(frozen=True, slots=True)
class Qos:
    weight: int = DEFAULT_WEIGHT
    read_bytes_per_s: int = 0  # 0: no limit
    write_bytes_per_s: int = 0
    requests_per_s: int = 0

    def public(self) -> dict[str, int]:
        return asdict(self)

    def with_(self, overrides: dict[str, int]) -> Qos:
        """This with the fields ``overrides`` sets (a tenant's, over the store's defaults)."""
        return Qos(**{**asdict(self), **overrides}) if overrides else self


def check_field(name: str, value: object, label: str) -> int:
    """``value`` of the QoS field ``name``, or a 400 naming ``label``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(f"field {label!r} must be an integer; got {value!r}")
    if name == "weight":
        if not 1 <= value <= MAX_WEIGHT:
            raise InvalidInput(f"field {label!r} must be 1 to {MAX_WEIGHT}; got {value}")
    elif not 0 <= value <= MAX_RATE:
        raise InvalidInput(f"field {label!r} must be 0 (no limit) to {MAX_RATE}; got {value}")
    return value


def parse_qos(value: object) -> dict[str, int | None]:
    """The changes a request body's ``qos`` object makes: each field named
    gets its value, or None (null: back to the store's default); ``qos``
    itself null: every field back to the store's default."""
    if value is None:
        return dict.fromkeys(QOS_FIELDS)
    if not isinstance(value, dict):
        raise InvalidInput(f"field 'qos' must be an object with {', '.join(QOS_FIELDS)}; got {value!r}"[:300])
    unknown = set(value) - set(QOS_FIELDS)
    if unknown:
        raise InvalidInput(
            f"unknown field(s) in 'qos': {', '.join(sorted(map(str, unknown)))[:200]}; expected {', '.join(QOS_FIELDS)}"
        )
    return {k: None if v is None else check_field(k, v, f"qos.{k}") for k, v in value.items()}


def apply_changes(overrides: dict[str, int], changes: dict[str, int | None]) -> dict[str, int]:
    """``overrides`` (what a tenant set) after ``changes`` (None: unset)."""
    out = dict(overrides)
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def stored_overrides(doc: Any) -> dict[str, int]:
    """A tenant's QoS as the registry file holds it (absent in older files)."""
    if not isinstance(doc, dict):
        return {}
    return {k: int(v) for k, v in doc.items() if k in QOS_FIELDS and isinstance(v, int)}

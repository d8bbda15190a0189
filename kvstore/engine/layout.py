"""Where kvstore keeps things in an object tier (the bucket layout), defined once.

    PREFIX/registry.json                                   the tenant registry
    PREFIX/segments/TENANT/INCARNATION/SEGMENT_ID.seg      one sealed segment

``INCARNATION`` is the tenant's creation time (16 hex digits): a tenant deleted
and created again under the same name starts a new directory, so its segment
ids never collide with the old incarnation's objects (which are deleted in the
background and could not be opened anyway: their keys were destroyed).
Objects are byte-for-byte the local sealed segment files: ciphertext for
sealed tenants, with the footer and trailer at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.engine.segment import parse_segment_name, segment_name

REGISTRY_OBJECT = "registry.json"
SEGMENTS = "segments/"


@dataclass(frozen=True, slots=True)
class SegmentObject:
    tenant: str
    incarnation: int
    segment_id: int

    @property
    def name(self) -> str:
        return segment_object(self.tenant, self.incarnation, self.segment_id)


def tenant_prefix(tenant: str, incarnation: int) -> str:
    return f"{SEGMENTS}{tenant}/{incarnation:016x}/"


def segment_object(tenant: str, incarnation: int, segment_id: int) -> str:
    return tenant_prefix(tenant, incarnation) + segment_name(segment_id)


def parse_segment_object(name: str) -> SegmentObject | None:
    """The parts of a segment object's name, or None for any other name."""
    if not name.startswith(SEGMENTS):
        return None
    parts = name[len(SEGMENTS) :].split("/")
    if len(parts) != 3 or len(parts[1]) != 16:
        return None
    try:
        incarnation = int(parts[1], 16)
    except ValueError:
        return None
    sid = parse_segment_name(parts[2])
    return None if sid is None else SegmentObject(parts[0], incarnation, sid)

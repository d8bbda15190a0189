"""The fleet's members as one node (or a client) sees them, and placement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvstore_client.sharding import normalize, rank_endpoints

State = Literal["alive", "dead"]
ALIVE: State = "alive"
DEAD: State = "dead"


@dataclass(frozen=True, slots=True)
class Member:
    id: str
    url: str
    state: State
    incarnation: int  # a restarted node is a new incarnation of its id
    last_seen: float  # unix seconds: when the observer last saw its heartbeat change (0: never seen)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "state": self.state,
            "incarnation": self.incarnation,
            "last_seen": round(self.last_seen, 3),
        }


@dataclass(frozen=True, slots=True)
class FleetView:
    """``version`` grows with every change of the membership document
    (a join, a rejoin, a death), the same number on every node."""

    version: int
    members: tuple[Member, ...]

    def member(self, node_id: str) -> Member | None:
        return next((m for m in self.members if m.id == node_id), None)

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.state == ALIVE]

    def urls(self) -> list[str]:
        """The alive members' URLs, as clients place keys over them."""
        return sorted(normalize(m.url) for m in self.alive())

    def owner(self, key: str) -> str | None:
        """The alive member's URL that rendezvous hashing places ``key`` on
        (the client library's own function): None with no member alive."""
        urls = self.urls()
        return rank_endpoints(urls, key)[0] if urls else None

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "nodes": [m.as_dict() for m in sorted(self.members, key=lambda m: m.id)]}

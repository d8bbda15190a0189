"""What a fleet node needs of a membership backend, in one small interface.

:class:`~kvstore.fleet.bucket.BucketMembership` implements it with objects
in the bucket (conditional writes, no other service),
:class:`~kvstore.fleet.etcd.EtcdMembership` with a lease per node in etcd.
A Kubernetes Lease per node could implement the same calls: join as a new
incarnation, prove liveness, read the members with the silent ones declared
dead, and fence a process that another incarnation of the same id has
replaced; and forget a dead node for good (an operator's decommission).
"""

from __future__ import annotations

from typing import Protocol

from kvstore.errors import KVStoreError
from kvstore.fleet.view import FleetView


class Superseded(KVStoreError):
    """Another process joined with this node's id (a newer incarnation):
    this one must stop writing."""

    code = "superseded"


class Membership(Protocol):
    node_id: str
    incarnation: int

    async def join(self) -> int:
        """Register this node as alive, as a new incarnation of its id (the
        previous one's + 1); returns the incarnation. Raises
        :class:`Superseded` if another process is joining with the same id."""
        ...

    async def heartbeat(self) -> None:
        """Prove this node alive now. Raises :class:`Superseded` if a newer
        incarnation of this id took over, a TierError if it could not."""
        ...

    async def observe(self) -> FleetView:
        """The members as the backend holds them, after declaring dead every
        alive member whose heartbeat has not changed for ``dead_after_s`` (as
        this node observed it), and rejoining this node (a new incarnation)
        if the others declared it dead while it was away."""
        ...

    async def remove(self, node_id: str) -> bool:
        """Forget a dead node for good (False: no such node; NodeAlive if alive)."""
        ...

    async def close(self) -> None:
        """Let go of what the backend holds open (its connections)."""
        ...

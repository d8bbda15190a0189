"""The node: what one daemon process serves, assembled in one place and in
one order, and taken apart in the reverse order.

:func:`open_node` opens, for a process of ``role`` "single", "writer" or
"reader":

1. the fleet's bucket and registry (a fleet node's writer: fleet.py), so the
   store opens with the fleet's tenants;
2. the store (recovery runs here; a reader opens the writer's files to read);
3. the worker's admission with the tenants' QoS (kvstore/qos/admission.py)
   and its flusher of what the worker served;
4. the event bus and its ZMQ publisher (the writer's: readers relay);
5. the NIXL agent and its sweeper (the writer's, where ``nixl`` is on);
6. the fleet membership, fencing and takeover (fleet.py).

The transports are adapters over the :class:`Node`: the HTTP application
(its routes, the fast lane, the unix socket), the S3 gateway and NIXL's
control calls take the store, the admission and the rest from it, and none
of them builds any of it (kvstore/daemon/app.py hands it to the HTTP app).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvstore import touchbells
from kvstore.daemon import fleet
from kvstore.engine.api import MasterKey, Store
from kvstore.events.bus import EventBus
from kvstore.events.zmq_pub import ZmqPublisher
from kvstore.fleet.node import FleetNode
from kvstore.fleet.shared import FleetFollower
from kvstore.fleet.takeover import Takeover
from kvstore.qos.admission import Admission
from kvstore.qos.buckets import RateTable
from kvstore.server_config import ServerConfig
from kvstore.tasks import Background
from kvstore.tier.base import Tier
from kvstore.transport.nixl.devices import discover
from kvstore.transport.nixl.service import XferService

log = logging.getLogger("kvstore.node")
FLUSH_S = 1.0  # how often a worker adds what it served to the node's counts
SWEEP_S = 1.0  # how often NIXL's expired leases and registrations are swept
ROLES = ("single", "writer", "reader")


@dataclass(frozen=True)
class Shared:
    """What the supervisor of several workers shares with each one it forks
    (memfds, made before the fork): the tenants' QoS buckets
    (kvstore/qos/buckets.py) and the writer's fleet state for the readers
    (kvstore/fleet/shared.py). None: this process's own (one worker)."""

    qos: int | None = None
    fleet: int | None = None
    # Each reader's bell (kvstore/touchbells.py: eventfds), and which one is this reader's (-1: none).
    bells: tuple[int, ...] = ()
    bell: int = -1


@dataclass
class Node:
    """One process's node, open. ``events``, ``xfer`` and the fleet's parts
    are None where the process runs none (a reader, ``nixl`` off, no fleet)."""

    config: ServerConfig
    role: str
    store: Store
    admission: Admission
    events: EventBus | None = None
    xfer: XferService | None = None
    fleet: FleetNode | None = None
    takeover: Takeover | None = None
    fleet_tier: Tier | None = None
    follower: FleetFollower | None = None  # a reader worker's view of the writer's fleet state
    ringer: touchbells.Ringer | None = None  # the writer's: rings the readers before the quota picks victims
    bell: touchbells.Bell | None = None  # a reader's: the writer's ring

    @property
    def reader(self) -> bool:
        return self.role == "reader"


@contextlib.asynccontextmanager
async def open_node(
    config: ServerConfig, master: MasterKey, role: str = "single", shared: Shared | None = None
) -> AsyncIterator[Node]:
    """The node of a process of ``role``, open for the ``async with`` block
    (module doc). ``shared``: what the workers share (:class:`Shared`)."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: expected single, writer or reader")
    reader = role == "reader"
    async with contextlib.AsyncExitStack() as stack:
        tier = None if reader else await stack.enter_async_context(fleet.fleet_bucket(config.store, master))
        store = await (Store.open_reader if reader else Store.open)(config.store, master)
        stack.push_async_callback(_close_store, store)
        # The recovery report as the line's fields (kvstore/logs.py): key=value, or JSON's own.
        log.info("store open at %s", config.store.data_dir, extra=store.recovery.as_dict())
        admission = Admission(
            store.metrics, config.max_concurrency, config.max_buffered_body_bytes, config.store.max_block_size
        )
        node = Node(config, role, store, admission, fleet_tier=tier)
        shared = shared or Shared()
        await stack.enter_async_context(_qos(node, shared.qos))
        if not reader:  # one event bus and one NIXL agent, the writer's: readers relay to them
            await stack.enter_async_context(_events(node))
            await stack.enter_async_context(_xfer(node))
            await stack.enter_async_context(fleet.fleet_membership(node, master))
            await stack.enter_async_context(fleet.publish_state(node, shared.fleet))
        elif config.store.fleet and shared.fleet is not None:
            await stack.enter_async_context(fleet.follow_state(node, shared.fleet))
        if not reader and shared.bells:
            node.ringer = touchbells.Ringer(shared.bells)
            store.gather_touches_with(node.ringer.sync)
        elif reader and 0 <= shared.bell < len(shared.bells):
            node.bell = touchbells.Bell(shared.bells[shared.bell], shared.bell)
        admission.ready = True
        try:
            yield node
        finally:
            admission.ready = False


async def _close_store(store: Store) -> None:
    await store.close()
    log.info("store closed")


@contextlib.asynccontextmanager
async def _qos(node: Node, qos_table: int | None) -> AsyncIterator[None]:
    """The tenants' QoS on the admission: the node's buckets (``qos_table``,
    every worker's; None: this process's own), and a flusher of what the
    worker served (the writer's flusher samples the rates the admin API shows)."""
    config, store, admission = node.config, node.store, node.admission
    admission.start(
        store.qos,
        RateTable(qos_table),
        config.qos_transfers_per_worker,
        config.qos_max_wait_ms / 1000,
        config.request_timeout_s,
    )
    answering = not node.reader  # the admin API's rates are the writer's to answer
    tasks = Background()
    tasks.every(
        FLUSH_S, lambda: admission.flush([t["name"] for t in store.tenants()] if answering else None), "qos-flusher"
    )
    try:
        yield
    finally:
        await tasks.close()
        admission.close()


@contextlib.asynccontextmanager
async def _events(node: Node) -> AsyncIterator[None]:
    """The bus (the store publishes to it) and, where ``events_zmq`` is set, the ZMQ publisher."""
    config, store = node.config, node.store
    bus = EventBus(config.events_backlog, config.events_queue, store.metrics)
    node.events = store.events = bus
    publisher = None
    if config.events_zmq:
        mediums = {"local": config.events_medium_local, "object": config.events_medium_object}
        publisher = ZmqPublisher(
            bus,
            config.events_zmq,
            config.events_zmq_replay,
            "array" if config.events_encoding == "array" else "map",
            mediums,
            config.events_backlog,
            store.metrics,
        )
        publisher.start()
    try:
        yield
    finally:
        store.events = None
        if publisher is not None:
            await publisher.close()


@contextlib.asynccontextmanager
async def _xfer(node: Node) -> AsyncIterator[None]:
    """Where ``nixl`` is on: the agent and its sweeper."""
    if not node.config.nixl:
        yield
        return
    found = await asyncio.to_thread(discover)
    service = node.xfer = XferService(node.store, node.config, found)
    tasks = Background()
    tasks.every(SWEEP_S, service.sweep, "nixl-sweeper")
    try:
        yield
    finally:
        await tasks.close()
        service.close()

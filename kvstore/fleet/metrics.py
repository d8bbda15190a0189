"""A fleet node's gauges in ``/metrics``: the members it sees, whether it is
fenced, the dead nodes' blocks it serves.

Set on the writer's (or a single process's) store metrics, the one process
that runs the node's part in the fleet: with several workers, the merged
exposition takes these gauges from the writer's snapshot alone (they are
not per-process gauges: kvstore/transport/http/metrics.py), so they are
never summed over workers. Recorded at every view change and every
heartbeat (:meth:`FleetGauges.run`): a fence that begins between two view
changes (a silence) shows within a heartbeat.

- ``kvstore_fleet_members{state=alive|dead}``: the members of this node's
  view, by state (a fenced node's view may be stale: see the next one);
- ``kvstore_fleet_fenced``: 1 while this node refuses writes
  (:meth:`FleetNode.fenced`), else 0;
- ``kvstore_fleet_adopted_nodes`` / ``kvstore_fleet_adopted_blocks``: the
  dead nodes whose blocks this node serves from the bucket, and those
  blocks (kvstore/fleet/takeover.py);
- ``kvstore_fleet_takeover_pending``: dead members whose blocks this node
  does not serve (yet): a takeover under way, or one that failed (its log
  says why).

The takeover's duration (``kvstore_fleet_takeover_seconds``) is observed
where a takeover ends, in kvstore/fleet/takeover.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from kvstore.engine.api import Store
from kvstore.errors import KVStoreError
from kvstore.fleet.node import FleetNode
from kvstore.fleet.takeover import Takeover
from kvstore.fleet.view import ALIVE, DEAD, FleetView
from kvstore.metrics import Metrics

log = logging.getLogger("kvstore.fleet")


class FleetGauges:
    """The gauges of ``node`` (and its ``takeover``) kept in ``metrics``."""

    def __init__(self, node: FleetNode, takeover: Takeover, metrics: Metrics) -> None:
        self.node = node
        self.takeover = takeover
        self.metrics = metrics

    async def record(self) -> None:
        """Set every gauge from the node's state now."""
        m, view = self.metrics, self.node.view
        for state in (ALIVE, DEAD):
            m.set("kvstore_fleet_members", sum(1 for x in view.members if x.state == state), state=state)
        m.set("kvstore_fleet_fenced", 1 if self.node.fenced() else 0)
        adopted = dict(self.takeover.adopted)
        m.set("kvstore_fleet_adopted_nodes", len(adopted))
        m.set("kvstore_fleet_adopted_blocks", await adopted_blocks(adopted.values()))
        me = self.node.node_id
        pending = [x.id for x in view.members if x.state == DEAD and x.id != me and x.id not in adopted]
        m.set("kvstore_fleet_takeover_pending", len(pending))

    async def on_view(self, old: FleetView, new: FleetView) -> None:
        """A FleetNode listener: the members' gauges at once on a change."""
        await self.record()

    async def run(self, every_s: float) -> None:
        """Record every ``every_s`` (the heartbeat) until cancelled."""
        failing = False
        while True:
            try:
                await self.record()
                failing = False
            except Exception:  # a gauge is not worth the loop: say so (once), try again next time
                if not failing:
                    log.exception("recording the fleet's gauges failed")
                failing = True
            await asyncio.sleep(every_s)


async def adopted_blocks(stores: Iterable[Store]) -> int:
    """The blocks of every tenant in the adopted ``stores``: their indexes'
    counts, one read each."""
    total = 0
    for store in stores:
        try:
            for tenant in store.tenant_names():
                total += (await store.stats(tenant)).blocks
        except KVStoreError:  # (closed as it is handed back, or a tenant deleted meanwhile)
            continue
    return total

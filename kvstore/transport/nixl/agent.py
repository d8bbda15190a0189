"""The daemon's NIXL agent.

One agent per daemon, in the writer process (reader workers relay
``/v1/xfer/*`` to it): the segment mappings it registers, the leases that pin
them and the staging memory live where the segment lifecycle is decided,
and UCX's progress thread moves the bytes, not the workers' Python.

The agent is made as the client makes its own (kvstore_client/wire/
nixl_loader.py), its progress thread sleeping ``PROGRESS_DELAY_US`` between
polls (NIXL's wrapper would spin a core). NIXL's own metadata listener (it
binds every interface) stays off: metadata travels over the HTTP control
calls.
"""

from __future__ import annotations

import logging
from typing import Any

from kvstore_client.wire import nixl_loader

from kvstore.errors import ConfigError
from kvstore.transport.nixl.devices import Discovery

log = logging.getLogger("kvstore.nixl")
PROGRESS_DELAY_US = 100  # between progress-thread polls: ~2% of a core idle, and faster over TCP


def ucx_devices(setting: str, found: Discovery) -> str | None:
    """UCX_NET_DEVICES for ``nixl_devices``: "auto" (the active RDMA ports
    pyverbs found; None, UCX's own choice, when there are none), "lo", or a
    list given as is."""
    if setting == "auto":
        active = found.active()
        return ",".join(p.ucx_name for p in active) if active else None
    return setting


def make_agent(name: str, backend: str, delay_us: int = PROGRESS_DELAY_US) -> Any:
    """A NIXL agent named ``name`` with ``backend`` and a progress thread
    that sleeps ``delay_us`` between polls (kvstore_client/wire/nixl_loader.py,
    as the client makes its own)."""
    try:
        agent = nixl_loader.make_agent(name, backend, delay_us)
    except ImportError as e:
        raise ConfigError(
            f"nixl = true needs the nixl package (pip install --no-deps nixl-cu12 nixl; see README): {e}"
        ) from None
    if backend not in agent.backends:
        raise ConfigError(f"nixl_backend={backend!r}: not among NIXL's plugins {sorted(agent.plugin_list)}")
    return agent

"""The daemon's NIXL agent.

One agent per daemon, in the writer process (reader workers relay
``/v1/xfer/*`` to it): the segment mappings it registers, the leases that pin
them and the staging memory live where the segment lifecycle is decided,
and UCX's progress thread moves the bytes, not the workers' Python.

NIXL's Python wrapper starts the progress thread with no delay between
polls, so an idle agent spins a core; the agent is created with a delay of
``PROGRESS_DELAY_US`` (the wrapper offers no option for it: its call into
the bindings is wrapped while the agent is made). NIXL's own metadata
listener (it binds every interface) stays off: metadata travels over the
HTTP control calls.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

from kvstore.errors import ConfigError
from kvstore.transport.nixl.devices import Discovery

log = logging.getLogger("kvstore.nixl")
PROGRESS_DELAY_US = 100  # between progress-thread polls: ~2% of a core idle, and faster over TCP
UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}  # measured faster over TCP
_make_lock = threading.Lock()


def ucx_devices(setting: str, found: Discovery) -> str | None:
    """UCX_NET_DEVICES for ``nixl_devices``: "auto" (the active RDMA ports
    pyverbs found; None, UCX's own choice, when there are none), "lo", or a
    list given as is."""
    if setting == "auto":
        active = found.active()
        return ",".join(p.ucx_name for p in active) if active else None
    return setting


def configure_ucx(devices: str | None, rdma: bool) -> None:
    """UCX reads its environment when the backend starts: set it before.
    Without RDMA devices (``rdma`` False) UCX's ib module is not loaded:
    it has nothing to drive, and the libnl it loads (bundled with nixl-cu12
    1.5.1) crashes the process at exit (SIGSEGV in its destructor)."""
    if devices is not None:
        os.environ["UCX_NET_DEVICES"] = devices
    if not rdma:
        os.environ.setdefault("UCX_MODULES", "^ib")
    for name, value in UCX_DEFAULTS.items():
        os.environ.setdefault(name, value)


def nixl_api() -> Any:
    """NIXL's Python API. ``nixl`` picks the wheel for the CUDA it detects and
    fails when that one is not installed (vLLM's CPU build makes it detect
    CUDA 13 beside an installed nixl-cu12): the installed wheels are then
    tried directly."""
    try:
        import nixl._api as api  # type: ignore[import-untyped]
    except ImportError as first:
        for wheel in ("nixl_cu12", "nixl_cu13"):
            try:
                return importlib.import_module(wheel + "._api")
            except ImportError:
                continue
        raise first from None
    return api


def make_agent(name: str, backend: str, delay_us: int = PROGRESS_DELAY_US) -> Any:
    """A NIXL agent named ``name`` with ``backend`` and a progress thread
    that sleeps ``delay_us`` between polls."""
    try:
        api = nixl_api()
    except ImportError as e:
        raise ConfigError(
            f"nixl = true needs the nixl package (pip install --no-deps nixl-cu12 nixl; see README): {e}"
        ) from None
    bindings: Any = api.nixlBind
    real = bindings.nixlAgent

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real(agent_name, config)

    with _make_lock:
        bindings.nixlAgent = with_delay
        try:
            agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, backends=[backend]))
        finally:
            bindings.nixlAgent = real
    if backend not in agent.backends:
        raise ConfigError(f"nixl_backend={backend!r}: not among NIXL's plugins {sorted(agent.plugin_list)}")
    return agent

"""Loading NIXL's Python API and making an agent, for the client and the daemon.

``pip install --no-deps nixl-cu12 nixl`` (its wheel declares torch, which
would pull a CUDA stack; host memory needs none of it).

NIXL's Python wrapper starts the progress thread with no delay between
polls, so an idle agent spins a core; :func:`make_agent` sets a delay (the
wrapper offers no option for it: its call into the bindings is wrapped
while the agent is made).
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}  # measured faster over TCP
_make_lock = threading.Lock()


def nixl_api() -> Any:
    """NIXL's Python API (ImportError without it). ``nixl`` picks the wheel
    for the CUDA it detects and fails when that one is not installed (vLLM's
    CPU build makes it detect CUDA 13 beside an installed nixl-cu12): the
    installed wheels are then tried directly."""
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


def make_agent(name: str, backend: str, delay_us: int) -> Any:
    """A NIXL agent named ``name`` with ``backend`` (and no metadata
    listener) whose progress thread sleeps ``delay_us`` between polls.
    ImportError without NIXL."""
    api = nixl_api()
    bindings: Any = api.nixlBind
    real = bindings.nixlAgent

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real(agent_name, config)

    with _make_lock:
        bindings.nixlAgent = with_delay
        try:
            return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, backends=[backend]))
        finally:
            bindings.nixlAgent = real


def configure_ucx(devices: str | None, rdma: bool) -> None:
    """UCX reads its environment when the backend starts: set it before
    making the agent. ``devices``: UCX_NET_DEVICES (None: UCX's own choice).
    Without RDMA devices (``rdma`` False) UCX's ib module is not loaded: it
    has nothing to drive, and the libnl it loads (bundled with nixl-cu12
    1.5.1) crashes the process at exit (SIGSEGV in its destructor)."""
    if devices is not None:
        os.environ["UCX_NET_DEVICES"] = devices
    if not rdma:
        os.environ.setdefault("UCX_MODULES", "^ib")
    for name, value in UCX_DEFAULTS.items():
        os.environ.setdefault(name, value)

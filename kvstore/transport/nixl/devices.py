"""RDMA devices, as rdma-core's pyverbs reports them.

UCX finds devices by itself; this is for people and for pointing UCX at the
right ones (``nixl_devices = "auto"``): each device's ports with their state,
link layer, speed, MTU and GIDs, or an empty list with the reason (pyverbs
missing, no devices, a device that cannot be opened).

pyverbs ships with rdma-core as a distribution package (Debian:
``python3-pyverbs``), not from PyPI (the PyPI ``pyverbs`` does not build
here): when the interpreter's own path does not have it, it is loaded from
the distribution's package directory, and only it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

DIST_PACKAGES = Path("/usr/lib/python3/dist-packages")
# ibv_port_state, ibv_mtu and link layers as rdma-core numbers them
_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_MTUS = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
# ibv_port_attr.active_speed (per lane, Gb/s) and active_width (lanes)
_SPEEDS = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.0, 16: 14.0, 32: 25.0, 64: 50.0, 128: 100.0}
_WIDTHS = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
MAX_GIDS = 16  # GIDs reported per port (RoCE ports have a few; the table may have hundreds of empty slots)


@dataclass(frozen=True, slots=True)
class Port:
    device: str
    port: int
    state: str
    link_layer: str
    speed_gbps: float | None
    mtu: int | None
    gids: list[str] = field(default_factory=list)

    @property
    def ucx_name(self) -> str:
        """The name UCX_NET_DEVICES takes: ``mlx5_0:1``."""
        return f"{self.device}:{self.port}"


@dataclass(frozen=True, slots=True)
class Discovery:
    ports: list[Port]
    reason: str | None  # why ``ports`` is empty (or partial)

    def as_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"devices": [asdict(p) for p in self.ports]}
        if self.reason:
            doc["reason"] = self.reason
        return doc

    def active(self) -> list[Port]:
        return [p for p in self.ports if p.state == "ACTIVE"]


def load_pyverbs() -> ModuleType | None:
    """pyverbs' ``device`` module, or None when it is not installed."""
    try:
        return importlib.import_module("pyverbs.device")
    except ImportError:
        pass
    init = DIST_PACKAGES / "pyverbs" / "__init__.py"
    if "pyverbs" in sys.modules or not init.is_file():
        return None
    spec = importlib.util.spec_from_file_location("pyverbs", init, submodule_search_locations=[str(init.parent)])
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = module
    try:
        spec.loader.exec_module(module)
        return importlib.import_module("pyverbs.device")
    except ImportError:  # built for another Python: as if it were absent
        for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
            del sys.modules[name]
        return None


def discover() -> Discovery:
    """The RDMA devices and ports of this host."""
    dev = load_pyverbs()
    if dev is None:
        return Discovery([], "pyverbs is not installed (Debian: apt install python3-pyverbs)")
    try:
        devices = dev.get_device_list()
    except Exception as e:  # noqa: BLE001 - pyverbs raises its own errors for "no devices"
        return Discovery([], f"no RDMA devices: {e}")
    if not devices:
        return Discovery([], "no RDMA devices")
    ports: list[Port] = []
    problems: list[str] = []
    for d in devices:
        name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
        try:
            with dev.Context(name=name) as ctx:
                for port in range(1, int(ctx.query_device().phys_port_cnt) + 1):
                    ports.append(_port(ctx, name, port))
        except Exception as e:  # noqa: BLE001 - one bad device must not hide the others
            problems.append(f"{name}: {e}")
    return Discovery(ports, "; ".join(problems) or None)


def _port(ctx: Any, name: str, port: int) -> Port:
    attr = ctx.query_port(port)
    lane = _SPEEDS.get(int(attr.active_speed))
    lanes = _WIDTHS.get(int(attr.active_width))
    gids: list[str] = []
    for index in range(min(int(attr.gid_tbl_len), MAX_GIDS)):
        try:
            gid = str(ctx.query_gid(port, index))
        except Exception:  # noqa: BLE001 - an unset GID slot
            continue
        if gid.strip("0:"):
            gids.append(gid)
    return Port(
        device=name,
        port=port,
        state=_STATES.get(int(attr.state), str(attr.state)),
        link_layer=_LINK_LAYERS.get(int(attr.link_layer), str(attr.link_layer)),
        speed_gbps=lane * lanes if lane and lanes else None,
        mtu=_MTUS.get(int(attr.active_mtu)),
        gids=gids,
    )

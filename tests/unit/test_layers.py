"""The tree's layers, as issue 25 drew them, checked on every import in it.

- No package of kvstore imports another that imports it back.
- kvstore/tier/ is a leaf: the backends import nothing of the engine.
- Transports (kvstore/transport/) and the daemon (kvstore/daemon.py, its
  command kvstore/cli.py and the shim server.py) see the engine
  only through its public API, kvstore.engine.api.
- The client distribution imports nothing of the daemon.
- The admin command (kvstore/admin/) imports nothing of kvstore but itself.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(module: str) -> str:
    """kvstore.<package> (or the root module itself) of a module."""
    return ".".join(module.split(".")[:2])


def _kvstore_modules() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in (ROOT / "kvstore").rglob("*.py")}


def test_no_package_imports_one_that_imports_it_back() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, imports in _kvstore_modules().items():
        for imported in imports:
            if imported.startswith("kvstore.") and _package(imported) != _package(module):
                edges[_package(module)].add(_package(imported))
    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and a in edges.get(b, set()))
    assert not cycles, cycles


def test_the_object_tier_is_a_leaf() -> None:
    for module, imports in _kvstore_modules().items():
        if module.startswith("kvstore.tier"):
            daemon = ("kvstore.engine", "kvstore.transport", "kvstore.config")
            wrong = sorted(i for i in imports if i.startswith(daemon))
            assert not wrong, f"{module} imports {wrong}"


def test_transports_see_the_engine_through_its_api() -> None:
    daemon = ("kvstore.transport", "kvstore.buckets", "kvstore.daemon", "kvstore.cli")
    users = {m: i for m, i in _kvstore_modules().items() if m.startswith(daemon)}
    assert "kvstore.daemon" in users
    users["server"] = _imports(ROOT / "server.py")
    for module, imports in users.items():
        wrong = sorted(i for i in imports if i.startswith("kvstore.engine") and i != "kvstore.engine.api")
        assert not wrong, f"{module} imports {wrong}: use kvstore.engine.api"


def test_the_client_imports_nothing_of_the_daemon() -> None:
    for path in (ROOT / "clients" / "kvstore_client").rglob("*.py"):
        wrong = sorted(i for i in _imports(path) if i == "kvstore" or i.startswith("kvstore."))
        assert not wrong, f"{path}: {wrong}"


def test_the_admin_command_is_a_client_of_the_api() -> None:
    """kvstore/admin/ speaks to a daemon over HTTP only: it imports nothing
    of kvstore but itself (not the engine, the config or the transports),
    so it neither reaches into a daemon nor loads one to start."""
    modules = {m: i for m, i in _kvstore_modules().items() if m == "kvstore.admin" or m.startswith("kvstore.admin.")}
    assert "kvstore.admin.client" in modules
    for module, imports in modules.items():
        wrong = sorted(
            i for i in imports if (i == "kvstore" or i.startswith("kvstore.")) and not i.startswith("kvstore.admin")
        )
        assert not wrong, f"{module} imports {wrong}: the admin command uses the daemon's HTTP API only"


COUNTED = ("kvstore_tenant_requests_total", "kvstore_http_bytes_in_total", "kvstore_http_bytes_out_total")


def test_every_transport_is_admitted_through_one_object() -> None:
    """Issue 39: the requests in flight, the tenants' shares, the QoS limits,
    the fair gate and the counts are decided in kvstore/qos/admission.py
    only; the transports hold a ticket, never the parts."""
    parts = ("kvstore.qos.limits", "kvstore.qos.shares", "kvstore.qos.fair")
    for module, imports in _kvstore_modules().items():
        if module.startswith("kvstore.qos"):
            continue
        wrong = sorted(i for i in imports if i.startswith(parts))
        assert not wrong, f"{module} imports {wrong}: go through kvstore.qos.admission"
    for path in (ROOT / "kvstore").rglob("*.py"):
        if path.name == "admission.py" and path.parent.name == "qos":
            continue
        text = path.read_text()
        counted = [name for name in COUNTED if f'"{name}"' in text]
        assert not counted, f"{path.relative_to(ROOT)} counts {counted}: count with a Ticket (kvstore.qos.admission)"

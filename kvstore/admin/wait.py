"""``--wait``: until a change of a fleet's tenant registry is in force on
every alive node.

A fleet node answers a registry change (a tenant created, changed or
deleted, a token or an S3 key issued or revoked, a tenant's key rotated)
with ``Kvstore-Registry-Revision: N``, the revision of the fleet's registry
it holds once the change is done; every node's ``GET /v1/admin/status``
reports the revision it holds (``fleet.registry_revision``). So: read the
alive members from the answering node (``GET /v1/fleet``, again every
round: one that dies meanwhile is no longer waited for, one that joins is),
ask each at its advertised URL for its status until every one holds ``N``
or more, or the time is up. Without the header (a node not in a fleet, an
answer that changed nothing) there is nothing to wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore.admin.client import Answer, Client
from kvstore.admin.errors import AdminError, NotEverywhere

REVISION_HEADER = "Kvstore-Registry-Revision"
HEARTBEATS = 5  # the default bound: a node takes a change within one heartbeat, plus its check's time
MIN_TIMEOUT_S = 5.0


def revision_of(answer: Answer) -> int | None:
    """The registry revision an answer says it wrote (None: not a fleet's change)."""
    raw = answer.header(REVISION_HEADER)
    return int(raw) if raw is not None and raw.isdigit() else None


def wait_for(
    client: Client,
    revision: int,
    timeout_s: float | None,
    say: Callable[[str], None],
) -> None:
    """Return once every alive member of ``client``'s fleet holds ``revision``;
    raise :class:`NotEverywhere` naming those that do not after ``timeout_s``
    (None: :data:`HEARTBEATS` of the answering node's heartbeat, at least
    :data:`MIN_TIMEOUT_S`). ``say``: progress for a person (stderr)."""
    status = client.get("/v1/admin/status").doc
    fleet = status.get("fleet") if isinstance(status, dict) else None
    if not isinstance(fleet, dict):
        return  # not a fleet node: the answer was in force everywhere it can be
    heartbeat = float(fleet.get("heartbeat_s") or 1.0)
    bound = timeout_s if timeout_s is not None else max(MIN_TIMEOUT_S, HEARTBEATS * heartbeat)
    pause = min(0.25, max(0.02, heartbeat / 4))
    start = time.monotonic()
    deadline = start + bound
    caught_up: set[str] = set()
    while True:
        behind = _behind(client, revision, max(0.5, deadline - time.monotonic()), caught_up)
        if not behind:
            say(f"in force on every alive node (registry revision {revision}) after {time.monotonic() - start:.1f} s")
            return
        if time.monotonic() >= deadline:
            nodes = "; ".join(f"{node} {why}" for node, why in sorted(behind.items()))
            raise NotEverywhere(f"registry revision {revision} not on every alive node within {bound:g} s: {nodes}")
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))


def _behind(client: Client, revision: int, timeout_s: float, caught_up: set[str]) -> dict[str, str]:
    """The alive members that do not hold ``revision`` yet, each with why
    (the revision it holds, its fence, or why it cannot be asked). Those
    found holding it join ``caught_up`` and are not asked again: a node's
    revision only grows (one that restarts takes the fleet's registry
    before it serves)."""
    view = client.bounded(timeout_s).get("/v1/fleet").doc
    out: dict[str, str] = {}
    for member in view.get("nodes", []) if isinstance(view, dict) else []:
        if member.get("state") != "alive":
            continue
        node, url = str(member.get("id")), str(member.get("url"))
        if node in caught_up:
            continue
        try:
            status = Client(url, client.token, timeout_s).get("/v1/admin/status").doc
        except AdminError as e:
            out[node] = f"({url}): {e}"
            continue
        fleet = status.get("fleet") if isinstance(status, dict) else None
        held = fleet.get("registry_revision") if isinstance(fleet, dict) else None
        if isinstance(held, int) and held >= revision:
            caught_up.add(node)
            continue
        fence = status.get("fence", {}) if isinstance(status, dict) else {}
        why = f"({url}) holds revision {held}"
        if isinstance(fence, dict) and fence.get("tenants_fenced"):
            why += f", and refuses tenant operations: {fence.get('tenants_reason', '')}"
        out[node] = why
    return out

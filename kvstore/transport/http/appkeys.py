"""What the application and a request carry: aiohttp's typed keys and their accessors.

The store, the settings, the metrics and the process's state (ready, requests
in flight, role) hang on the application; every route and middleware reads
them through these keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvstore.engine.api import BlockInfo, Store
from kvstore.errors import NotFound
from kvstore.fleet.shared import FleetFollower
from kvstore.metrics import Metrics
from kvstore.server_config import ServerConfig

STORE = web.AppKey("store", Store)
CONFIG = web.AppKey("config", ServerConfig)
METRICS = web.AppKey("metrics", Metrics)
STATE = web.AppKey("state", dict[str, Any])
# A fleet node's reader worker: its writer's fleet state (kvstore/fleet/shared.py).
FOLLOWER = web.AppKey("fleet_follower", FleetFollower)
# The tenant the request's bearer token names, once authenticated (auth.tenant_of).
TENANT = web.RequestKey("tenant", str)
# A fleet node's reader worker did not know the request's token: its writer checks the
# fleet's registry now and answers (routes/fleet.tenant_in_fleet, forward.relayed).
RELAY_UNKNOWN_TOKEN = web.RequestKey("relay_unknown_token", bool)


@dataclass(frozen=True, slots=True)
class Resolved:
    """What the fast lane resolved of a block read it handed to the route
    after all (a limit to wait for, a read that needs I/O): the block's head
    (``info``), or the miss (``missing``), both counted already. The route
    goes on from here; it does not look the block up again."""

    key: str
    info: BlockInfo | None = None
    missing: NotFound | None = None


RESOLVED = web.RequestKey("resolved", Resolved)
# The request's Expect header, taken from aiohttp by the connection layer
# (connection.KVAppRunner) and answered by the gate (middleware.gate_middleware).
EXPECT = web.RequestKey("expect", str)


def store_of(request: web.Request) -> Store:
    return request.app[STORE]


def config_of(request: web.Request) -> ServerConfig:
    return request.app[CONFIG]


def route_of(request: web.Request) -> str:
    """The matched route's pattern (``/v1/blocks/{key}``), or "unmatched"."""
    info = request.match_info
    resource = info.route.resource if info.route is not None else None
    return resource.canonical if resource is not None else "unmatched"


def client_gone(request: web.Request) -> bool:
    """Whether the client's connection is closed or closing."""
    transport = request.transport
    return transport is None or transport.is_closing()

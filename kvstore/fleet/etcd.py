"""Membership on etcd: a lease per node instead of heartbeat objects.

For operators who run etcd (``fleet_etcd_url``). The tenant registry and the
segments stay in the bucket; only membership moves. Keys under the fleet's
key prefix (one per bucket and prefix, so fleets sharing an etcd stay apart):

- ``PREFIX/fleet/members.json``: the members document, the same JSON as the
  bucket's (kvstore/fleet/bucket.py), changed in transactions that compare
  its ``mod_revision`` (its absence for the first), redone on a conflict.
- ``PREFIX/alive/ID``: ``{"incarnation", "url"}``, attached to node ID's
  lease (TTL ``fleet_dead_after_s``). The node renews the lease every
  ``fleet_heartbeat_s``; when it stops, etcd expires the lease and deletes
  the key. So etcd's clock decides how long a node may be silent, and an
  observer declares dead every node listed alive whose key is gone.

A node whose key holds a newer incarnation than its own was replaced by
another process with its id (superseded). The wire is etcd's v3 JSON
gateway (``/v3/kv/...``, ``/v3/lease/...``): no client library, no gRPC.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import aiohttp

from kvstore.errors import TierConflict, TierError
from kvstore.fleet.bucket import (
    MEMBERS,
    change_object,
    declare_dead,
    dump_doc,
    listed_incarnation,
    load_doc,
    remove_member,
    set_alive,
    view_of,
)
from kvstore.fleet.membership import Superseded
from kvstore.fleet.view import ALIVE, FleetView

log = logging.getLogger("kvstore.fleet")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


class Etcd:
    """The few etcd v3 calls membership needs, over its JSON gateway. Keys
    are names under ``prefix``; etags are ``mod_revision``\\ s. Every failure
    is a :class:`TierError` (the fleet's "could not reach the shared state")."""

    def __init__(self, url: str, prefix: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.prefix = prefix
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.post(f"{self.url}/v3/{path}", json=body) as r:
                text = await r.text()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise TierError(f"etcd at {self.url}: {path}: {type(e).__name__}: {e}") from None
        try:
            doc = json.loads(text) if text else {}
        except ValueError:
            doc = {}
        if status != 200 or not isinstance(doc, dict) or "error" in doc:
            why = doc.get("message") or doc.get("error") if isinstance(doc, dict) else None
            raise TierError(f"etcd at {self.url}: {path}: HTTP {status}: {why or text[:200]!r}")
        return doc

    @contextlib.contextmanager
    def _answer(self, path: str) -> Iterator[None]:
        """Reading an answer of ``path``: one that lacks what etcd always
        sends is a TierError too (the fleet's loop goes on), not a KeyError."""
        try:
            yield
        except (KeyError, TypeError, ValueError, AttributeError, binascii.Error) as e:
            raise TierError(f"etcd at {self.url}: {path}: an unexpected answer ({type(e).__name__}: {e})") from None

    def _key(self, name: str) -> bytes:
        return (self.prefix + name).encode()

    async def get(self, name: str) -> tuple[bytes, str] | None:
        got = await self._call("kv/range", {"key": _b64(self._key(name))})
        with self._answer("kv/range"):
            kvs = got.get("kvs") or []
            if not kvs:
                return None
            return base64.b64decode(kvs[0].get("value", "")), str(kvs[0]["mod_revision"])

    async def put_if(self, name: str, data: bytes, etag: str | None, lease: int = 0) -> str:
        """``data`` as ``name`` only if its ``mod_revision`` is still ``etag``
        (None: only if absent); the new etag, or :class:`TierConflict`."""
        key = _b64(self._key(name))
        cmp: dict[str, Any] = {"key": key, "result": "EQUAL"}
        if etag is None:
            cmp |= {"target": "CREATE", "create_revision": "0"}
        else:
            cmp |= {"target": "MOD", "mod_revision": etag}
        put: dict[str, Any] = {"key": key, "value": _b64(data)}
        if lease:
            put["lease"] = str(lease)
        got = await self._call("kv/txn", {"compare": [cmp], "success": [{"request_put": put}]})
        if not got.get("succeeded", False):
            raise TierConflict(f"etcd: {self.prefix + name} changed since it was read")
        with self._answer("kv/txn"):
            return str(got["header"]["revision"])

    async def scan(self, name_prefix: str) -> dict[str, bytes]:
        """Every name under ``name_prefix`` (the part after it) and its value."""
        start = self._key(name_prefix)
        got = await self._call("kv/range", {"key": _b64(start), "range_end": _b64(_prefix_end(start))})
        with self._answer("kv/range"):
            return {
                base64.b64decode(kv["key"])[len(start) :].decode(): base64.b64decode(kv.get("value", ""))
                for kv in got.get("kvs") or []
            }

    async def grant(self, ttl_s: int) -> int:
        got = await self._call("lease/grant", {"TTL": str(ttl_s)})
        with self._answer("lease/grant"):
            return int(got["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its TTL, 0 if it has expired."""
        try:
            got = await self._call("lease/keepalive", {"ID": str(lease)})
        except TierError as e:
            if "not found" in str(e):
                return 0
            raise
        with self._answer("lease/keepalive"):
            return int((got.get("result") or {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("lease/revoke", {"ID": str(lease)})
        except TierError as e:
            if "not found" not in str(e):
                raise


class EtcdMembership:
    """:class:`~kvstore.fleet.membership.Membership` on etcd leases."""

    def __init__(self, etcd: Etcd, node_id: str, url: str, dead_after_s: float) -> None:
        self.etcd = etcd
        self.node_id = node_id
        self.url = url
        self.ttl_s = max(2, math.ceil(dead_after_s))  # etcd's leases are whole seconds, 2 at least
        self.incarnation = 0
        self._lease = 0
        self._seen: dict[str, float] = {}  # unix seconds: when this node last saw a member's key

    @property
    def _alive_key(self) -> str:
        return f"alive/{self.node_id}"

    async def _alive(self) -> tuple[int, str | None]:
        """The incarnation in this node's key (0: none) and the key's etag."""
        got = await self.etcd.get(self._alive_key)
        if got is None:
            return 0, None
        return int(load_doc(got[0], "an alive key").get("incarnation", 0)), got[1]

    async def _write_alive(self, etag: str | None) -> None:
        """This node's key, as this incarnation on the lease it holds, if the
        key is still what was read (``etag``); else another process wrote it."""
        value = dump_doc({"incarnation": self.incarnation, "url": self.url})
        try:
            await self.etcd.put_if(self._alive_key, value, etag, self._lease)
        except TierConflict:
            raise Superseded(f"another process wrote node {self.node_id!r}'s key (a newer incarnation)") from None

    async def join(self) -> int:
        previous, etag = await self._alive()
        self.incarnation = max(previous, listed_incarnation(await self.etcd.get(MEMBERS), self.node_id)) + 1
        self._lease = await self.etcd.grant(self.ttl_s)
        try:
            await self._write_alive(etag)
        except Superseded:
            await self.etcd.revoke(self._lease)
            raise
        await change_object(self.etcd, MEMBERS, set_alive(self.node_id, self.incarnation, self.url))
        log.info("joined the fleet (etcd) as node %s, incarnation %d, at %s", self.node_id, self.incarnation, self.url)
        return self.incarnation

    async def heartbeat(self) -> None:
        ttl = await self.etcd.keepalive(self._lease)
        theirs, etag = await self._alive()
        if theirs > self.incarnation:
            raise Superseded(f"node {self.node_id!r} joined again as incarnation {theirs} elsewhere")
        if ttl > 0 and etag is not None:
            return
        # The lease expired (the others see this node dead, or soon will): a
        # new lease and the key again; observe() then rejoins if it was declared dead.
        self._lease = await self.etcd.grant(self.ttl_s)
        await self._write_alive(etag)
        log.warning("node %s: its etcd lease had expired; took a new one", self.node_id)

    async def observe(self) -> FleetView:
        got = await self.etcd.get(MEMBERS)
        doc: dict[str, Any] = load_doc(got[0], MEMBERS) if got is not None else {"version": 0, "nodes": {}}
        nodes: dict[str, Any] = doc.get("nodes", {})
        keys = await self.etcd.scan("alive/")
        now = time.time()
        for node_id in keys:
            self._seen[node_id] = now
        silent = {
            i: int(e["incarnation"])
            for i, e in nodes.items()
            if i != self.node_id and e["state"] == ALIVE and i not in keys
        }
        mine = nodes.get(self.node_id)
        if mine is not None and self.incarnation and int(mine["incarnation"]) > self.incarnation:
            raise Superseded(f"node {self.node_id!r} joined again as incarnation {mine['incarnation']} elsewhere")
        away = mine is not None and mine["state"] != ALIVE and bool(self.incarnation)
        if away:
            assert mine is not None
            # Declared dead while its lease had expired: a new incarnation, on the lease it holds now.
            self.incarnation = max(self.incarnation, int(mine["incarnation"])) + 1
            await self._write_alive((await self._alive())[1])
            await change_object(self.etcd, MEMBERS, set_alive(self.node_id, self.incarnation, self.url))
            log.warning("node %s was declared dead; rejoined as incarnation %d", self.node_id, self.incarnation)
        if silent:
            await change_object(self.etcd, MEMBERS, declare_dead(silent))
            for i in silent:
                log.warning("node %s: its etcd lease expired; declared dead", i)
        if away or silent:
            got = await self.etcd.get(MEMBERS)
            doc = load_doc(got[0], MEMBERS) if got is not None else doc
        return view_of(doc, self._seen)

    async def remove(self, node_id: str) -> bool:
        found = await remove_member(self.etcd, node_id)
        self._seen.pop(node_id, None)
        return found

    async def close(self) -> None:
        await self.etcd.close()

"""The store's tenants: create, change limits, delete (crypto-shred), their
bearer tokens and S3 keys, data-key and master-key rotation, and a reader
process following the writer's registry."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvstore.config import FRAME_SIZE_RULE, QUOTA_EVICTION, valid_frame_size
from kvstore.engine.access import Touches
from kvstore.engine.admission import DEFAULT_ADMIT_WINDOW_S, MAX_ADMIT_AFTER, MAX_ADMIT_WINDOW_S
from kvstore.engine.appender import OpenSegment
from kvstore.engine.crypto import MasterKey, load_master_key
from kvstore.engine.recovery import trash
from kvstore.engine.registry import Tenant
from kvstore.engine.store_core import StoreCore, log
from kvstore.errors import InvalidInput, KVStoreError, MasterKeyError, TenantNotFound
from kvstore.fsutil import atomic_write
from kvstore.names import validate_tenant
from kvstore.qos.policy import Qos, apply_changes

T = TypeVar("T")
MASTER_KEY_HINT = "master-key.path"  # where the last rotation's new key file is (a path, never a key)


class StoreTenants(StoreCore):
    # A fleet node (set by the daemon, kvstore/fleet/node.py): bearer tokens
    # and S3 keys are refused while it raises (Fenced: the node cannot
    # confirm that its registry is the fleet's newest, so one revoked on
    # another node might pass here).
    tenant_fence: Callable[[], None] | None = None

    def refresh(self) -> None:
        """A reader: pick up the writer's registry changes (tenants, tokens,
        keys), following a master-key rotation through the path it left."""
        if not self.readonly:
            return
        before = self._registry.incarnations()
        try:
            self._registry.refresh()
        except MasterKeyError:
            hint = self._root / MASTER_KEY_HINT
            try:
                new = load_master_key(hint.read_text().strip())
            except (OSError, MasterKeyError) as e:
                log.error("registry changed under a new master key, which this process cannot load: %s", e)
                return
            self._registry.use_master(new)
            try:
                self._registry.refresh()
            except MasterKeyError as e:  # rotated again meanwhile: serve the last view, retry next time
                self._registry.use_master(self._master)
                log.warning("registry changed under a master key this process cannot load yet: %s", e)
                return
            self._master = new
        after = self._registry.incarnations()
        for name, created in before.items():
            if after.get(name) != created:  # deleted, maybe created again: segment ids start over
                self._cache.forget_tenant(name)
                self.access.forget_tenant(name)
                self.decoded.drop_tenant(name)

    async def create_tenant(
        self,
        name: str,
        policy: str = "sealed",
        compression: str | None = None,
        durability: str | None = None,
        quota_bytes: int | None = None,
        ttl_s: int | None = None,
        frame_size: int | None = None,
        events_topic: str | None = None,
        qos: dict[str, int | None] | None = None,
        admit_after: int | None = None,
        admit_window_s: int | None = None,
        *,
        eviction: str | None = None,
    ) -> dict[str, Any]:
        """``durability``: persistent (never dropped before it is in the object
        tier) or ephemeral (may be dropped when the disk is full); default the
        ``default_durability`` setting. ``quota_bytes`` and ``ttl_s``: None for
        the configured defaults, 0 for none. ``frame_size``: plaintext bytes
        per frame of its records (a ranged read of a sealed block decodes the
        frames it covers); None or 0 for the store's ``frame_size``.
        ``events_topic``: the ZMQ topic of its residency events (None or "":
        its name). ``qos``: the QoS fields it sets (kvstore/qos/policy.py; the
        others, and those None, follow the ``default_qos_*`` settings).
        ``admit_after``: a block it does not hold is stored only at its
        ``admit_after``-th offer within ``admit_window_s`` seconds
        (engine/admission.py); None: 1 (every time), and 3600 s.
        ``eviction``: which blocks its quota takes (engine/eviction.py);
        None or "": the node's ``quota_eviction``."""
        self._check_writable()
        validate_tenant(name)
        if compression is None and policy == "sealed":
            compression = self.config.compression
        durability = durability or self.config.default_durability
        quota = self.config.default_quota_bytes if quota_bytes is None else _limit("quota_bytes", quota_bytes)
        ttl = self.config.default_ttl_s if ttl_s is None else _limit("ttl_s", ttl_s)
        fs = _frame_size(frame_size or 0)
        topic = _topic(events_topic or "")
        after = 1 if admit_after is None else _admit_after(admit_after)
        window = DEFAULT_ADMIT_WINDOW_S if admit_window_s is None else _admit_window(admit_window_s)
        policy_of_quota = _eviction(eviction or "")
        self._check_composes(policy_of_quota, after)
        await self._run(trash, self._seg_root, name)  # files of a deleted incarnation, if any are left
        own = apply_changes({}, qos or {})
        await self._change_registry(
            False,
            functools.partial(self._registry.create, eviction=policy_of_quota),
            name,
            policy,
            compression,
            durability,
            quota,
            ttl,
            fs,
            topic,
            own,
            after,
            window,
        )
        self._tails[name] = OpenSegment(None)
        return self.tenant(name)

    async def set_limits(
        self,
        name: str,
        quota_bytes: int | None = None,
        ttl_s: int | None = None,
        frame_size: int | None = None,
        events_topic: str | None = None,
        qos: dict[str, int | None] | None = None,
        admit_after: int | None = None,
        admit_window_s: int | None = None,
        *,
        eviction: str | None = None,
    ) -> dict[str, Any]:
        """Change a tenant's quota, TTL, frame size, events topic, QoS fields,
        admission and eviction (None: unchanged; 0: none, or the store's frame
        size; eviction "": the node's ``quota_eviction``).
        A lower quota is enforced in the background, started before this
        returns (``quota_enforcement`` in the answer says how many bytes are
        over it; :meth:`quota_enforced` waits for it), a shorter TTL on the
        next read and sweep; a frame size applies to the records written from now on (each
        record keeps the one it has); admission to the next put (offers
        counted so far still count, under the new window; ``admit_after``
        1 drops them)."""
        self._check_writable()
        await self._known(name)
        quota = None if quota_bytes is None else _limit("quota_bytes", quota_bytes)
        ttl = None if ttl_s is None else _limit("ttl_s", ttl_s)
        fs = None if frame_size is None else _frame_size(frame_size)
        topic = None if events_topic is None else _topic(events_topic)
        after = None if admit_after is None else _admit_after(admit_after)
        window = None if admit_window_s is None else _admit_window(admit_window_s)
        policy_of_quota = None if eviction is None else _eviction(eviction)
        now = self._registry.get(name)
        self._check_composes(now.eviction if policy_of_quota is None else policy_of_quota, after or now.admit_after)
        t = await self._change_registry(
            True,
            functools.partial(self._registry.set_limits, eviction=policy_of_quota),
            name,
            quota,
            ttl,
            fs,
            topic,
            qos,
            after,
            window,
        )
        if t.admit_after == 1:
            self.admission.forget_tenant(name)
        over = self._index.stats(name).stored_bytes - t.quota_bytes if t.quota_bytes else 0
        if over > 0:
            self._start_enforcing(t)
        return {**self.tenant(name), "quota_enforcement": {"over_bytes": max(0, over), "started": over > 0}}

    def _check_composes(self, eviction: str, admit_after: int) -> None:
        """Admission (``admit_after`` > 1) is refused with a tenant's own
        ``probation`` (and a tenant with admission that sets no eviction
        evicts by ``lru`` whatever the node's: Retention.policy): both spare
        the disk the blocks used once, and together they lose the first
        reuses for nothing (bench/README.md, *Eviction*: below either alone
        on Mooncake's synthetic trace)."""
        if admit_after > 1 and eviction == "probation":
            raise InvalidInput(
                "field 'admit_after' must be 1 under eviction 'probation': both keep blocks used once off the "
                "disk, and together they lose the first reuses (below either alone); set eviction 'lru' (or null) "
                "to use admission"
            )

    def _start_enforcing(self, t: Tenant) -> None:
        """Enforce ``t``'s quota in the background, down to the quota itself
        (in steps: retention.py), after any enforcement already running."""
        before = self._enforcing.get(t.name)

        async def enforce() -> int:
            if before is not None:
                await asyncio.wait([before])
            try:
                return await self._retention.enforce(t, 0, low=1.0)
            except KVStoreError as e:  # the tenant deleted meanwhile, a full disk: said, not raised
                log.warning("enforcing the quota of %s stopped: %s", t.name, e)
                return 0

        task = self._residency.spawn(enforce(), f"quota:{t.name}")
        self._enforcing[t.name] = task

        def ended(done: asyncio.Task[int]) -> None:
            if self._enforcing.get(t.name) is done:
                del self._enforcing[t.name]

        task.add_done_callback(ended)

    async def quota_enforced(self, name: str) -> None:
        """Wait for the enforcement of a lowered quota (if one runs) to end."""
        task = self._enforcing.get(name)
        if task is not None:
            await asyncio.wait([task])

    def touches(self) -> Touches:
        """A reader process: the accesses it served since the last call, for
        the writer (:meth:`absorb_touches`), which owns the access times."""
        return self.access.drain()

    def absorb_touches(self, touches: Touches) -> None:
        self.access.merge(touches)

    def gather_touches_with(self, gather: Callable[[], Awaitable[None]] | None) -> None:
        """The writer of several workers: ``gather()`` brings the readers'
        accesses in (kvstore/touchbells.py); the quota awaits it before it
        picks victims, so a block just read on a reader is as recent as it is."""
        self._retention.gather_touches = gather

    async def expire(self, tenant: str | None = None) -> int:
        """Remove the blocks past their tenant's TTL now (normally the sweeper does)."""
        self._check_writable()
        return await self._retention.sweep(tenant)

    def tenants(self) -> list[dict[str, Any]]:
        self._check_open()
        return [self.tenant(n) for n in self._registry.names() if n not in self._deleting]

    def tenant(self, name: str) -> dict[str, Any]:
        """What an operator sees of a tenant; ``qos`` as it applies (the
        store's defaults where the tenant sets nothing)."""
        return {**self._tenant(name).public(), "qos": self.qos(name).public()}

    def qos(self, name: str) -> Qos:
        """The tenant's QoS: its own fields over the store's defaults."""
        own = self._tenant(name).qos
        hit = self._qos.get(name)
        if hit is not None and hit[0] is own:  # (a change, or a reload, makes a new dict)
            return hit[1]
        c = self.config
        base = Qos(
            c.default_qos_weight, c.default_read_bytes_per_s, c.default_write_bytes_per_s, c.default_requests_per_s
        )
        qos = base.with_(own)
        self._qos[name] = (own, qos)
        return qos

    async def delete_tenant(self, name: str) -> None:
        """Crypto-shred: destroy the tenant's keys, then drop its index and files.
        The files are moved aside in one rename, then removed in the background."""
        self._check_writable()
        t = await self._known(name)
        forget = functools.partial(self._change_registry, True, self._registry.delete, name)
        await self._drop_tenant(name, t.created_ns, t.events_topic, forget)

    async def _drop_tenant(
        self, name: str, incarnation: int, topic: str, forget: Callable[[], Awaitable[Any]] | None
    ) -> None:
        """Drop what this node holds of incarnation ``incarnation`` of tenant
        ``name`` (``topic``: for its last event) once ``forget`` has taken it
        out of the registry (a delete here; None: the fleet's registry, which
        no longer has it, is this node's already)."""
        self._deleting.add(name)
        self.decoded.drop_tenant(name)
        try:
            app = self._appenders.pop(name, None)
            if app is not None:
                await app.close()
            if forget is not None:
                await forget()
            await self._maintain(self._life.tenant_deleted, name)
            self._cache.forget_tenant(name)  # closed once the reads in progress end
            self.access.forget_tenant(name)
            self.admission.forget_tenant(name)
            self._retention.forget_tenant(name)
            self._residency.tenant_deleted(name, incarnation)
            moved = await self._run(trash, self._seg_root, name)
            self._tails.pop(name, None)
            if self.events is not None:
                self.events.publish(name, "cleared", "tenant_deleted", topic=topic)
        finally:
            self._deleting.discard(name)
        if moved is not None:
            self._residency.spawn(self._run(shutil.rmtree, moved, True), f"remove:{name}")

    async def _change_registry(self, maintain: bool, fn: Callable[..., T], *args: Any) -> T:
        """A registry change, run as :meth:`_maintain` (``maintain``: it must
        work on a full disk) or :meth:`_run`; on a fleet node, a change of the
        fleet's registry (kvstore/fleet/registry.py)."""

        async def apply() -> T:
            return await (self._maintain(fn, *args) if maintain else self._run(fn, *args))

        if self.fleet_registry is None:
            return await apply()
        return await self.fleet_registry.change(apply)

    async def _known(self, name: str) -> Tenant:
        """The tenant, for a change of it; a fleet node that does not know it
        yet takes the fleet's registry first (it may have been created on
        another node since the last refresh)."""
        try:
            return self._tenant(name)
        except TenantNotFound:
            if self.fleet_registry is None or name in self._deleting:
                raise
        await self.fleet_registry.sync()
        return self._tenant(name)

    def tenant_names(self) -> list[str]:
        """The tenants, by name (those being deleted left out)."""
        self._check_open()
        return [n for n in self._registry.names() if n not in self._deleting]

    def events_topic(self, tenant: str) -> str:
        """The ZMQ topic of the tenant's residency events ("" for its name)."""
        return self._topic(tenant)

    def registry_document(self) -> bytes:
        """The tenant registry's document (data keys wrapped, tokens hashed)."""
        return self._registry.document()

    async def adopt_registry(self, doc: bytes) -> bool:
        """A fleet node: make the fleet's registry document this node's, and
        drop what this node holds of the tenants it no longer has (deleted on
        another node, maybe created again: a new incarnation). True if it
        changed anything."""
        before = {n: self._registry.get(n) for n in self._registry.names()}
        changed = await self._run(self._registry.adopt, doc)
        if not changed:
            return False
        after = self._registry.incarnations()
        for name, t in before.items():
            if after.get(name) != t.created_ns:
                log.info("tenant %s was deleted on another node of the fleet; dropping it here", name)
                await self._drop_tenant(name, t.created_ns, t.events_topic, None)
        for name in set(after) - set(before):
            log.info("tenant %s was created on another node of the fleet", name)
        return True

    def authenticate(self, token: str) -> str | None:
        """The tenant a bearer token names, or None (unknown, revoked, deleted);
        Fenced while the tenant fence is up (a fleet node, ``tenant_fence``)."""
        self._check_open()
        if self.tenant_fence is not None:
            self.tenant_fence()
        self.refresh()
        name = self._registry.tenant_for_token(token)
        return None if name is None or name in self._deleting else name

    async def issue_token(self, name: str) -> tuple[str, str]:
        """A new bearer token for the tenant: (token id, token), shown once."""
        self._check_writable()
        await self._known(name)
        return await self._change_registry(False, self._registry.issue_token, name)

    async def revoke_token(self, name: str, token_id: str) -> None:
        self._check_writable()
        await self._known(name)
        await self._change_registry(True, self._registry.revoke_token, name, token_id)  # works on a full disk

    async def issue_s3_key(self, name: str) -> tuple[str, str]:
        """A new S3 access key for the tenant: (access key id, secret), shown once."""
        self._check_writable()
        await self._known(name)
        return await self._change_registry(False, self._registry.issue_s3_key, name)

    async def revoke_s3_key(self, name: str, access_key_id: str) -> None:
        self._check_writable()
        await self._known(name)
        await self._change_registry(True, self._registry.revoke_s3_key, name, access_key_id)  # works on a full disk

    def s3_credentials(self, access_key_id: str) -> tuple[str, str, int] | None:
        """(tenant, secret access key, the tenant's incarnation) of an S3
        access key id; None if unknown, revoked or its tenant deleted;
        Fenced while the tenant fence is up (``tenant_fence``)."""
        self._check_open()
        if self.tenant_fence is not None:
            self.tenant_fence()
        self.refresh()
        found = self._registry.s3_secret(access_key_id)
        if found is None or found[0] in self._deleting:
            return None
        return found[0], found[1], self._registry.get(found[0]).created_ns

    def incarnation(self, name: str) -> int | None:
        """The tenant's incarnation (its creation time), None if it does not exist."""
        return None if name not in self._registry or name in self._deleting else self._registry.get(name).created_ns

    async def rotate_tenant_key(self, name: str) -> int:
        self._check_writable()
        await self._known(name)
        version = await self._change_registry(False, self._registry.rotate_data_key, name)
        self.decoded.drop_tenant(name)  # reader workers: at their next read of it (decoded.py)
        return version

    async def rotate_master_key(self, new_master: MasterKey, key_file: str | None = None) -> None:
        """Rewrap every data key under ``new_master``; start with it from now on.
        ``key_file``, the new key's path, is recorded (the path, never the key)
        for reader processes of this store to follow."""
        self._check_writable()
        if self.fleet_registry is not None:
            raise InvalidInput(
                "the master key of a fleet node cannot be rotated through its API: every node of the fleet "
                "shares it (stop the fleet, rotate it on one node, give every node the new key)"
            )
        if key_file:  # first: a reader that sees the rewrapped registry must find the key it needs
            await self._run(atomic_write, self._root / MASTER_KEY_HINT, os.path.abspath(key_file).encode())
        await self._run(self._registry.rotate_master, new_master)
        self._master = new_master


def _limit(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise InvalidInput(f"field {name!r} must be null or a non-negative integer, got {value!r}")
    return value


def _topic(value: str) -> str:
    if (
        not isinstance(value, str)
        or len(value.encode()) > 256
        or not all(c.isprintable() and not c.isspace() for c in value)
    ):
        raise InvalidInput("field 'events_topic' must be up to 256 bytes of printable text without spaces, or null")
    return value


def _admit_after(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ADMIT_AFTER:
        raise InvalidInput(
            f"field 'admit_after' must be an integer from 1 (store every block) to {MAX_ADMIT_AFTER}; got {value!r}"
        )
    return value


def _eviction(value: object) -> str:
    """A tenant's ``eviction``: one of QUOTA_EVICTION, or "" for the node's."""
    if value != "" and value not in QUOTA_EVICTION:
        raise InvalidInput(
            f"field 'eviction' must be one of {', '.join(QUOTA_EVICTION)}, or null for the node's quota_eviction; "
            f"got {value!r}"
        )
    return str(value)


def _admit_window(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ADMIT_WINDOW_S:
        raise InvalidInput(f"field 'admit_window_s' must be an integer from 1 to {MAX_ADMIT_WINDOW_S}; got {value!r}")
    return value


def _frame_size(value: int) -> int:
    if value and not valid_frame_size(value):
        raise InvalidInput(f"field 'frame_size' {FRAME_SIZE_RULE}, or null for the store's; got {value!r}")
    return value

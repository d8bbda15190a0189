"""The tenant registry: policies and wrapped data keys, in one JSON file.

The registry is not a cache: it cannot be rebuilt from segments (it holds the
only copies of the wrapped data keys), so it lives apart from the LMDB index,
is replaced atomically, and never holds a key in the clear. Deleting a tenant
removes its keys from here first: from then on its records cannot be opened
(crypto-shredding), whatever is still on disk.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvstore_client.wire.sealing import aad

from kvstore import __version__
from kvstore.config import COMPRESSIONS, DURABILITY_CLASSES, Compression, DurabilityClass
from kvstore.engine.admission import DEFAULT_ADMIT_WINDOW_S
from kvstore.engine.crypto import MasterKey, new_data_key
from kvstore.errors import (
    InvalidInput,
    MasterKeyError,
    NewerFormat,
    NotFound,
    ReadOnlyStore,
    TenantExists,
    TenantKeyDestroyed,
    TenantNotFound,
)
from kvstore.fsutil import atomic_write, fsync_dir
from kvstore.names import validate_tenant
from kvstore.qos.policy import apply_changes, stored_overrides

Policy = Literal["sealed", "direct"]
POLICIES: tuple[Policy, ...] = ("sealed", "direct")
REGISTRY_VERSION = 1  # written; docs/operations.md lists every persisted format's version
REGISTRY_VERSIONS_READ = (1,)  # a newer one is refused (NewerFormat), the file left as it is
TOKEN_PREFIX = "kvs_"
MAX_DELETED_REMEMBERED = 10_000


class RegistryUnreadable(MasterKeyError):
    """The registry file exists but cannot be read or parsed."""

    code = "registry_unreadable"


class UnknownTenantSetting(RegistryUnreadable):
    """The registry reads, but a tenant's policy, compression or durability is
    one this release does not know. The data is whole: the advice for an
    unreadable registry next to tenant data (restore it, or discard the
    tenants) does not apply; upgrading does."""


def _name_digest(name: str) -> str:
    return hashlib.sha256(b"kvstore/deleted-tenant\x00" + name.encode()).hexdigest()[:32]


S3_KEY_PREFIX = "KVS"
_AKID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


def _s3_aad(tenant: str, access_key_id: str) -> bytes:
    return aad(b"kvstore/v1 s3 secret", tenant, access_key_id)


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(slots=True)
class Tenant:
    name: str
    policy: Policy
    compression: Compression
    created_ns: int
    key_version: int = 0  # current data key version; 0 for direct tenants
    wrapped_keys: dict[int, str] = field(default_factory=dict)
    tokens: dict[str, dict[str, Any]] = field(default_factory=dict)  # token id -> {"sha256", "created_ns"}
    # persistent: never dropped before it is in the object tier; ephemeral:
    # G3 only, its sealed segments may be dropped under disk pressure.
    durability: DurabilityClass = "persistent"
    quota_bytes: int = 0  # bytes stored across tiers; 0: no quota (retention.py)
    ttl_s: int = 0  # a block neither read nor written for this long is a miss; 0: none
    frame_size: int = 0  # plaintext bytes per frame of new records; 0: the store's frame_size
    events_topic: str = ""  # the ZMQ topic of its residency events; "": its name
    # S3 gateway credentials: access key id -> {"secret": sealed under the
    # master key (SigV4 verification needs the secret itself), "created_ns"}
    s3_keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    # QoS fields set on the tenant (kvstore/qos/policy.py); the others follow
    # the store's defaults.
    qos: dict[str, int] = field(default_factory=dict)
    # Admission (engine/admission.py): a block it does not hold is stored at
    # its admit_after-th offer within admit_window_s of the first; 1: every time.
    admit_after: int = 1
    admit_window_s: int = DEFAULT_ADMIT_WINDOW_S
    # Which blocks its quota takes (engine/eviction.py); "": the node's
    # quota_eviction. A value this release does not know is read as "".
    eviction: str = ""

    @property
    def sealed(self) -> bool:
        return self.policy == "sealed"

    def public(self) -> dict[str, Any]:
        """What may be shown to an operator: never the keys."""
        return {
            "name": self.name,
            "policy": self.policy,
            "compression": self.compression,
            "created_ns": self.created_ns,
            "key_version": self.key_version,
            "durability": self.durability,
            "quota_bytes": self.quota_bytes or None,
            "ttl_s": self.ttl_s or None,
            "frame_size": self.frame_size or None,
            "events_topic": self.events_topic or None,
            "qos": dict(self.qos),
            "admit_after": self.admit_after,
            "admit_window_s": self.admit_window_s,
            "eviction": self.eviction or None,
            "tokens": [{"id": tid, "created_ns": t["created_ns"]} for tid, t in sorted(self.tokens.items())],
            "s3_keys": [{"access_key_id": k, "created_ns": v["created_ns"]} for k, v in sorted(self.s3_keys.items())],
        }


class Registry:
    def __init__(self, path: Path, master: MasterKey, readonly: bool = False) -> None:
        """``readonly``: another process makes the changes; :meth:`refresh`
        picks them up (the file is replaced atomically, never edited)."""
        self._path = path
        self._readonly = readonly
        self._stamp: tuple[int, int, int] | None = None
        self._master = master
        self._lock = threading.Lock()
        self._tenants: dict[str, Tenant] = {}
        self._keys: dict[tuple[str, int], bytes] = {}
        self._by_hash: dict[str, tuple[str, str]] = {}
        self._by_akid: dict[str, str] = {}  # S3 access key id -> its tenant
        # Tenants deleted (a digest of the name -> when; names are not kept):
        # their leftover files may be removed at start-up. A directory of a
        # tenant that is neither live nor deleted means the registry is not the
        # one the data was written with (a lost or old file): the store refuses
        # to start (recovery.py).
        self._deleted: dict[str, int] = {}
        self._parts: dict[str, bytes] = {}  # each tenant's part of the document, encoded (_doc)
        self._order: list[str] | None = None  # the tenants' names in order (_doc), made again when they change
        # Each tenant's part, in that order, after ", " (the first one's dropped when written): the
        # document is written from these buffers as they are (writev), never joined into one.
        self._listed: list[bytes] = []
        # Called (on the changing thread) after every change is on disk: the
        # object tier keeps a copy of the registry.
        self.on_change: Callable[[], None] | None = None
        if path.exists() or readonly:
            self._load()
        else:
            self._save()
        self._reindex()

    def _file_stamp(self) -> tuple[int, int, int]:
        st = self._path.stat()
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def refresh(self) -> bool:
        """Reload the file if another process replaced it; True when it did."""
        try:
            stamp = self._file_stamp()
        except OSError:
            return False
        if stamp == self._stamp:
            return False
        with self._lock:
            fresh = Registry(self._path, self._master, readonly=True)
            self._tenants, self._keys, self._by_hash = fresh._tenants, fresh._keys, fresh._by_hash
            self._parts.clear()
            self._order = None
            self._by_akid = fresh._by_akid
            self._deleted = fresh._deleted
            self._stamp = fresh._stamp
        return True

    # -- persistence ----------------------------------------------------------

    def _load(self) -> None:
        try:
            self._stamp = self._file_stamp()
            doc = json.loads(self._path.read_bytes())
        except (OSError, ValueError) as e:
            raise RegistryUnreadable(f"tenant registry {str(self._path)!r} cannot be read: {e}") from None
        if not isinstance(doc, dict):
            raise RegistryUnreadable(f"tenant registry {str(self._path)!r} is not a registry document")
        version = doc.get("version")
        if NewerFormat.is_newer(version, REGISTRY_VERSIONS_READ):
            raise NewerFormat(
                f"tenant registry {str(self._path)!r}",
                version,
                REGISTRY_VERSIONS_READ,
                restore="registry.json (and the data directory with it)",
            )
        if version not in REGISTRY_VERSIONS_READ or not isinstance(doc.get("tenants"), dict):
            raise RegistryUnreadable(
                f"tenant registry {str(self._path)!r} is not a registry document "
                f"(version {version!r}; kvstore writes version {REGISTRY_VERSION})"
            )
        if doc.get("master_key_id") != self._master.key_id:
            raise MasterKeyError(
                f"the master key (id {self._master.key_id}) is not the one this store was created with "
                f"(id {doc.get('master_key_id')}); refusing to start"
            )
        for name, t in doc["tenants"].items():
            _known_values(self._path, name, t)
            tenant = Tenant(
                name=name,
                policy=t["policy"],
                compression=t["compression"],
                created_ns=t["created_ns"],
                key_version=t["key_version"],
                wrapped_keys={int(v): w for v, w in t["keys"].items()},
                tokens=dict(t.get("token_hashes", {})),
                durability=t.get("durability", "persistent"),
                quota_bytes=int(t.get("quota_bytes") or 0),
                ttl_s=int(t.get("ttl_s") or 0),
                frame_size=int(t.get("frame_size") or 0),
                events_topic=str(t.get("events_topic") or ""),
                s3_keys=dict(t.get("s3_secrets", {})),
                qos=stored_overrides(t.get("qos")),
                admit_after=int(t.get("admit_after") or 1),
                admit_window_s=int(t.get("admit_window_s") or DEFAULT_ADMIT_WINDOW_S),
                eviction=str(t.get("eviction") or ""),
            )
            self._tenants[name] = tenant
            for version, wrapped in tenant.wrapped_keys.items():
                self._keys[(name, version)] = self._master.unwrap(wrapped, name, version)
        self._deleted = {str(k): int(v) for k, v in doc.get("deleted_tenants", {}).items()}

    def _doc(self, master: MasterKey) -> bytes:
        """The registry document (JSON), as one string."""
        return b"".join(self._doc_parts(master))

    def _doc_parts(self, master: MasterKey) -> list[bytes | memoryview]:
        """The registry document (JSON), as the buffers it is written from.
        Each tenant's part is kept encoded until the tenant changes (``_save``
        names it) and kept in order, so that a change costs a write of the
        parts, not an encoding of every tenant or a join of them all:
        creating the 10,000th tenant used to encode all of them (42-70 ms by
        the thousandth), then to join 3.3 MB twice (8.5 ms)."""
        if master is not self._master:  # a master key rotation: every part changes
            self._parts.clear()
            self._order = None
        if self._order is None or len(self._order) != len(self._tenants):
            self._order = sorted(self._tenants)
            get, part = self._parts.get, self._part
            self._listed = [b", " + (get(name) or part(name)) for name in self._order]
        listed: list[bytes | memoryview] = [memoryview(self._listed[0])[2:], *self._listed[1:]] if self._listed else []
        return [
            b'{"deleted_tenants": ',
            _dumps(self._deleted),
            b', "master_key_id": ',
            _dumps(master.key_id),
            b', "tenants": {',
            *listed,
            b'}, "version": ',
            _dumps(REGISTRY_VERSION),
            b"}",
        ]

    def _part(self, name: str) -> bytes:
        """Tenant ``name``'s part of the document, encoded and kept."""
        part = self._parts[name] = json.dumps(name).encode() + b": " + _dumps(self._tenant_doc(name))
        return part

    def _tenant_doc(self, name: str) -> dict[str, Any]:
        t = self._tenants[name]
        return {
            **{k: v for k, v in t.public().items() if k not in ("tokens", "s3_keys")},
            "keys": {str(v): w for v, w in t.wrapped_keys.items()},
            "token_hashes": t.tokens,
            "s3_secrets": t.s3_keys,
        }

    def _save(self, *changed: str) -> None:
        """Write the registry after a change of the tenants ``changed`` (none
        named: any may have changed)."""
        if self._readonly:
            raise ReadOnlyStore("this process serves reads only; changes go to the writer")
        if changed:
            for name in changed:
                self._parts.pop(name, None)
                if self._order is not None:  # kept in order: a tenant created, changed or deleted
                    i = bisect.bisect_left(self._order, name)
                    listed = i < len(self._order) and self._order[i] == name
                    if name in self._tenants and not listed:
                        self._order.insert(i, name)
                        self._listed.insert(i, b", " + self._part(name))
                    elif name in self._tenants:
                        self._listed[i] = b", " + self._part(name)
                    elif listed:
                        del self._order[i]
                        del self._listed[i]
        else:
            self._parts.clear()
            self._order = None
        self._write(self._doc_parts(self._master))
        self._changed()

    def _write(self, doc: bytes | Sequence[bytes | memoryview]) -> None:
        """Replace the file with ``doc``. A change is all or nothing: if the
        file cannot be written (a full disk, EIO), what is in memory goes back
        to what the file says (the caller holds the lock), and the error is
        raised, so a retry (reserve.py) finds the registry as it was."""
        try:
            atomic_write(self._path, doc)
        except BaseException:
            if self._path.exists():
                fresh = Registry(self._path, self._master, readonly=True)
                self._tenants, self._keys, self._deleted = fresh._tenants, fresh._keys, fresh._deleted
                self._parts.clear()
                self._order = None
                self._stamp = fresh._stamp
                self._reindex()
            raise

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def adopt(self, doc: bytes) -> bool:
        """Make ``doc`` this registry: another node's document (the fleet's
        registry, kvstore/fleet/registry.py), checked as at start-up (sealed
        under this store's master key), then written and loaded. False if it
        is what this registry already holds."""
        if self._readonly:
            raise ReadOnlyStore("this process serves reads only; changes go to the writer")
        with self._lock:
            if doc == self._doc(self._master):
                return False
            fresh = _install_checked(self._path, doc, self._master)
            self._tenants, self._keys, self._by_hash = fresh._tenants, fresh._keys, fresh._by_hash
            self._parts.clear()
            self._order = None
            self._by_akid, self._deleted = fresh._by_akid, fresh._deleted
            self._stamp = self._file_stamp()
        self._changed()
        return True

    def document(self) -> bytes:
        """The registry as stored (data keys wrapped, tokens as hashes only)."""
        with self._lock:
            return self._doc(self._master)

    # -- queries --------------------------------------------------------------

    def get(self, name: str) -> Tenant:
        t = self._tenants.get(name)
        if t is None:
            raise TenantNotFound(f"tenant {name!r} does not exist")
        return t

    def names(self) -> list[str]:
        return sorted(self._tenants)

    def incarnations(self) -> dict[str, int]:
        """Each tenant's creation time: a tenant deleted and created again
        under the same name is another incarnation, with other segments."""
        return {name: t.created_ns for name, t in self._tenants.items()}

    def was_deleted(self, name: str) -> bool:
        """Whether a tenant of this name was deleted (and not created again)."""
        return _name_digest(name) in self._deleted

    def __contains__(self, name: object) -> bool:
        return name in self._tenants

    def tenant_for_token(self, token: str) -> str | None:
        """The tenant a bearer token belongs to, or None. Tokens are stored as
        SHA-256 hashes only; the hash is compared in constant time."""
        digest = _token_hash(token)
        found = self._by_hash.get(digest)
        if found is None or not hmac.compare_digest(found[1], digest):
            return None
        return found[0]

    def s3_secret(self, access_key_id: str) -> tuple[str, str] | None:
        """(tenant, secret access key) of an S3 access key id, or None."""
        name = self._by_akid.get(access_key_id)
        t = self._tenants.get(name) if name is not None else None
        entry = t.s3_keys.get(access_key_id) if t is not None else None
        if t is None or entry is None:
            return None
        return t.name, self._master.open(entry["secret"], _s3_aad(t.name, access_key_id)).decode()

    def data_key(self, name: str, version: int) -> bytes:
        k = self._keys.get((name, version))
        if k is None:
            raise TenantKeyDestroyed(f"data key version {version} of tenant {name!r} does not exist")
        return k

    # -- changes --------------------------------------------------------------

    def create(
        self,
        name: str,
        policy: str = "sealed",
        compression: str | None = None,
        durability: str = "persistent",
        quota_bytes: int = 0,
        ttl_s: int = 0,
        frame_size: int = 0,
        events_topic: str = "",
        qos: dict[str, int] | None = None,
        admit_after: int = 1,
        admit_window_s: int = DEFAULT_ADMIT_WINDOW_S,
        *,
        eviction: str = "",
    ) -> Tenant:
        validate_tenant(name)
        if policy not in POLICIES:
            raise InvalidInput(f"policy={policy!r}: expected one of {', '.join(POLICIES)}")
        if durability not in DURABILITY_CLASSES:
            raise InvalidInput(f"durability={durability!r}: expected one of {', '.join(DURABILITY_CLASSES)}")
        comp = compression or ("none" if policy == "direct" else "zstd-bp2")
        if comp not in COMPRESSIONS:
            raise InvalidInput(f"compression={compression!r}: expected one of {', '.join(COMPRESSIONS)}")
        if policy == "direct" and comp != "none":
            raise InvalidInput("compression must be 'none' for a direct tenant (stored raw for zero-copy reads)")
        with self._lock:
            if name in self._tenants:
                raise TenantExists(f"tenant {name!r} already exists")
            t = Tenant(
                name,
                policy,
                comp,
                time.time_ns(),
                durability=durability,
                quota_bytes=quota_bytes,
                ttl_s=ttl_s,
                frame_size=frame_size,
                events_topic=events_topic,
                qos=dict(qos or {}),
                admit_after=admit_after,
                admit_window_s=admit_window_s,
                eviction=eviction,
            )
            self._deleted.pop(_name_digest(name), None)
            if policy == "sealed":
                self._add_key(t)
            self._tenants[name] = t
            self._save(name)
            return t

    def _add_key(self, t: Tenant) -> None:
        version = t.key_version + 1
        key = new_data_key()
        t.wrapped_keys[version] = self._master.wrap(key, t.name, version)
        t.key_version = version
        self._keys[(t.name, version)] = key

    def issue_token(self, name: str) -> tuple[str, str]:
        """A new bearer token for ``name``: (token id, token). The token itself
        is returned once and never stored."""
        with self._lock:
            t = self.get(name)
            token = TOKEN_PREFIX + secrets.token_urlsafe(32)
            digest = _token_hash(token)
            token_id = digest[:16]
            t.tokens[token_id] = {"sha256": digest, "created_ns": time.time_ns()}
            self._save(name)
            self._reindex()
            return token_id, token

    def issue_s3_key(self, name: str) -> tuple[str, str]:
        """A new S3 access key of ``name``: (access key id, secret access key).
        The secret is stored sealed under the master key."""
        with self._lock:
            t = self.get(name)
            akid = S3_KEY_PREFIX + "".join(secrets.choice(_AKID_ALPHABET) for _ in range(17))
            secret = secrets.token_urlsafe(30)[:40]
            sealed = self._master.seal(secret.encode(), _s3_aad(name, akid))
            t.s3_keys[akid] = {"secret": sealed, "created_ns": time.time_ns()}
            self._save(name)
            self._reindex()
            return akid, secret

    def revoke_s3_key(self, name: str, access_key_id: str) -> None:
        with self._lock:
            t = self.get(name)
            if access_key_id not in t.s3_keys:
                raise NotFound(f"tenant {name!r} has no S3 access key {access_key_id[:32]!r}")
            del t.s3_keys[access_key_id]
            self._save(name)
            self._reindex()

    def revoke_token(self, name: str, token_id: str) -> None:
        with self._lock:
            t = self.get(name)
            if token_id not in t.tokens:
                raise NotFound(f"tenant {name!r} has no token {token_id!r}")
            del t.tokens[token_id]
            self._save(name)
            self._reindex()

    def _reindex(self) -> None:
        self._by_hash = {
            tok["sha256"]: (t.name, tok["sha256"]) for t in self._tenants.values() for tok in t.tokens.values()
        }
        self._by_akid = {akid: t.name for t in self._tenants.values() for akid in t.s3_keys}

    def set_limits(
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
    ) -> Tenant:
        """Change the tenant's quota, TTL, frame size of new records, events
        topic, QoS fields, admission and eviction (None: leave as is; 0 or
        "": none, the store's frame size, the tenant's name, the node's
        eviction; a QoS field None: the store's default)."""
        with self._lock:
            t = self.get(name)
            if qos:
                t.qos = apply_changes(t.qos, qos)
            if events_topic is not None:
                t.events_topic = events_topic
            if quota_bytes is not None:
                t.quota_bytes = quota_bytes
            if ttl_s is not None:
                t.ttl_s = ttl_s
            if frame_size is not None:
                t.frame_size = frame_size
            if admit_after is not None:
                t.admit_after = admit_after
            if admit_window_s is not None:
                t.admit_window_s = admit_window_s
            if eviction is not None:
                t.eviction = eviction
            self._save(name)
            return t

    def rotate_data_key(self, name: str) -> int:
        """New records of ``name`` use a new data key; old ones keep theirs."""
        with self._lock:
            t = self.get(name)
            if not t.sealed:
                raise InvalidInput(f"tenant {name!r} is direct: it has no data key to rotate")
            self._add_key(t)
            self._save(name)
            return t.key_version

    def delete(self, name: str) -> None:
        """Destroy the tenant's data keys (crypto-shred) and forget it."""
        with self._lock:
            self.get(name)
            del self._tenants[name]
            for k in [k for k in self._keys if k[0] == name]:
                del self._keys[k]
            self._deleted[_name_digest(name)] = time.time_ns()
            if len(self._deleted) > MAX_DELETED_REMEMBERED:
                for old in sorted(self._deleted, key=self._deleted.__getitem__)[:-MAX_DELETED_REMEMBERED]:
                    del self._deleted[old]
            self._save(name)
            self._reindex()

    def use_master(self, master: MasterKey) -> None:
        """A reader: unwrap with ``master`` from now on (after a rotation)."""
        self._master = master

    def rotate_master(self, new_master: MasterKey) -> None:
        """Rewrap every data key under ``new_master``; no data is rewritten."""
        with self._lock:
            for t in self._tenants.values():
                for version in t.wrapped_keys:
                    t.wrapped_keys[version] = new_master.wrap(self._keys[(t.name, version)], t.name, version)
                for akid, entry in t.s3_keys.items():
                    secret = self._master.open(entry["secret"], _s3_aad(t.name, akid))
                    entry["secret"] = new_master.seal(secret, _s3_aad(t.name, akid))
            self._write(self._doc(new_master))
            self._master = new_master
        self._changed()


def adopt_registry_file(path: Path, doc: bytes, master: MasterKey) -> bool:
    """Before a store opens: make ``doc`` (another node's registry document,
    kvstore/fleet/registry.py) the registry file at ``path``, checked first
    (sealed under ``master``, a registry document); False if it already is."""
    if path.exists() and path.read_bytes() == doc:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    _install_checked(path, doc, master)
    return True


def _install_checked(path: Path, doc: bytes, master: MasterKey) -> Registry:
    """Replace the registry file at ``path`` with ``doc`` once it loads (a
    wrong master key or a bad document stops here, the file untouched);
    the registry it holds."""
    tmp = path.with_name(path.name + ".adopt")
    atomic_write(tmp, doc)
    try:
        fresh = Registry(tmp, master, readonly=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    fsync_dir(path.parent)
    return fresh


def _known_values(path: Path, name: str, t: dict[str, Any]) -> None:
    """Refuse a tenant whose policy, compression or durability this release
    does not know (a newer release's, or an edited file), rather than load
    it as something else: an unknown policy read as "not sealed" would have
    the tenant's next blocks written in plaintext."""
    for setting, known in (
        ("policy", POLICIES),
        ("compression", COMPRESSIONS),
        ("durability", DURABILITY_CLASSES),
    ):
        value = t.get(setting, "persistent" if setting == "durability" else None)
        if value not in known:
            raise UnknownTenantSetting(
                f"tenant registry {str(path)!r}: tenant {name!r} has {setting} {value!r}, which this kvstore "
                f"({__version__}) does not know (it knows {', '.join(known)}): a newer kvstore wrote it, or the "
                "file was edited; refusing to start rather than take the tenant for another "
                f"{setting} (docs/operations.md)"
            )


def _dumps(value: object) -> bytes:
    return json.dumps(value, sort_keys=True).encode()

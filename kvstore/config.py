"""Store configuration: defaults, ``KVSTORE_*`` environment overrides, validation.

A bad value is refused with the setting's name and the value; nothing falls
back to a default silently.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from kvstore.errors import ConfigError
from kvstore.names import NODE_ID

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
Durability = Literal["fsync", "interval"]
# The compressions a tenant may choose (engine/codec.py implements them).
Compression = Literal["none", "zstd", "zstd-bp2"]
COMPRESSIONS: tuple[Compression, ...] = ("none", "zstd", "zstd-bp2")
DurabilityClass = Literal["persistent", "ephemeral"]
DURABILITY_CLASSES: tuple[DurabilityClass, ...] = ("persistent", "ephemeral")
S3_ADDRESSING = ("auto", "path", "virtual")
QUOTA_EVICTION = ("lru", "probation")  # engine/eviction.py

_SIZE_RE = re.compile(r"(\d+)\s*(|b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": KiB, "m": MiB, "g": GiB, "t": GiB << 10}


def parse_size(name: str, value: object) -> int:
    """Parse ``value`` as a byte count: an int, or text like ``256MiB`` / ``4k``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: expected a size in bytes such as 268435456 or 256MiB")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value.strip())
        if m:
            return int(m.group(1)) * _UNITS[m.group(2)[:1].lower()]
    raise ConfigError(f"{name}={value!r}: expected a size in bytes such as 268435456 or 256MiB")


def parse_int(name: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        return int(value)
    raise ConfigError(f"{name}={value!r}: expected an integer")


def parse_float(name: str, value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{name}={value!r}: expected a number")


def parse_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{name}={value!r}: expected true or false")


def parse_text(name: str, value: object) -> str:
    if isinstance(value, str):
        return value.strip()
    raise ConfigError(f"{name}={value!r}: expected a string")


def parse_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in choices:
        return value
    raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")


# seal_after_s on a fleet node that does not set it: a node's death loses at
# most the blocks acknowledged in the last ~10 s plus an upload (docs/fleet.md),
# for at most 360 segment objects an hour per tenant written to.
FLEET_SEAL_AFTER_S = 10.0

FRAME_SIZE_RULE = "must be a multiple of 4 KiB from 4 KiB to 64 MiB"


def valid_frame_size(n: int) -> bool:
    return 4 * KiB <= n <= 64 * MiB and n % (4 * KiB) == 0


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of the storage engine. Sizes are in bytes."""

    data_dir: Path
    segment_size: int = 256 * MiB
    frame_size: int = 1 * MiB
    max_block_size: int = 64 * MiB
    durability: Durability = "fsync"
    sync_interval_ms: int = 50
    compression: Compression = "zstd-bp2"
    zstd_level: int = 1
    max_batch_bytes: int = 64 * MiB
    # Records are appended with O_DIRECT (no page-cache copy): "auto" where the
    # filesystem takes it, "on" refuses to start where it does not, "off" never.
    direct_io: str = "auto"
    io_threads: int = max(4, 2 * (os.cpu_count() or 2))
    # Local space: the data directory may use ``capacity`` bytes (0: its whole
    # filesystem). Above ``high_watermark`` percent of it, droppable segments
    # are dropped, least recently read first, down to ``low_watermark``.
    capacity: int = 0
    high_watermark: int = 90
    low_watermark: int = 80
    # Bytes set aside on the data directory's filesystem that only removals
    # and maintenance may use, so a full disk never wedges the store
    # (engine/reserve.py); 0: one segment, at most a tenth of the filesystem.
    space_reserve: int = 0
    default_durability: DurabilityClass = "persistent"
    # G4, the object tier: no bucket means G3 only. Credentials come from the
    # standard AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...).
    s3_bucket: str = ""
    # ...or a directory (NFS or other shared storage) as the object tier.
    tier_dir: str = ""
    s3_endpoint: str = ""
    s3_prefix: str = ""
    s3_region: str = ""
    s3_addressing: str = "auto"
    s3_upload_concurrency: int = 4
    s3_read_timeout_ms: int = 5000
    s3_readonly: bool = False
    s3_refresh_s: int = 30
    rehydrate_reads: int = 3
    # A fleet of nodes on one bucket (kvstore/fleet/): membership and the
    # tenant registry are objects in the bucket, each node's segments under
    # PREFIX/nodes/NODE_ID. node_id "": generated once, kept in DATA/node-id;
    # advertise_url "": http://HOST:PORT of the first TCP listen address.
    fleet: bool = False
    node_id: str = ""
    advertise_url: str = ""
    fleet_heartbeat_s: float = 2.0
    fleet_dead_after_s: float = 6.0
    # How long a survivor goes on serving the blocks it took over from a node
    # that came back (kvstore/fleet/takeover.py): clients that have not read
    # the membership since (fleet_refresh_s, 5 s by default) still find them there.
    fleet_handback_s: float = 10.0
    # Membership on etcd leases instead of the bucket (kvstore/fleet/etcd.py):
    # its v3 JSON gateway, e.g. http://etcd-0:2379; "": membership in the bucket.
    fleet_etcd_url: str = ""
    # Seal (and so mirror) a tenant's open segment once its oldest unsealed
    # record is this many seconds old (engine/sealer.py): what a node loses
    # when it dies is bounded in time. None (unset): FLEET_SEAL_AFTER_S on a
    # fleet node, off elsewhere; 0: off. Read it through :attr:`seal_after`.
    seal_after_s: float | None = None
    # Start-up: delete the data of tenants the registry does not know, instead
    # of refusing to start (the registry was lost or replaced by an old copy).
    discard_unknown_tenants: bool = False
    # Tenants created without them get these (0: none); PATCH changes them.
    default_quota_bytes: int = 0
    default_ttl_s: int = 0
    # Which blocks a tenant over its quota gives up where it sets no
    # "eviction" of its own (engine/eviction.py): "lru", or "probation"
    # (blocks not read since they were stored go first).
    quota_eviction: str = "lru"
    # Admission (engine/admission.py): the keys whose offers are counted per
    # tenant with admit_after > 1 (about 180 bytes each, in the writer's
    # memory); past it the longest tracked are forgotten first.
    admission_keys: int = 500_000
    # QoS of tenants that do not set their own (kvstore/qos/policy.py): weight
    # under contention, and node-wide limits (0: none).
    default_qos_weight: int = 100
    default_read_bytes_per_s: int = 0
    default_write_bytes_per_s: int = 0
    default_requests_per_s: int = 0
    # How often blocks past their TTL are removed (they are misses from the
    # moment they expire; this gives their space back).
    ttl_sweep_s: int = 30
    # Compaction: sealed segments whose dead bytes (deleted, expired, evicted
    # records) are at least compact_dead_percent of their records are rewritten
    # by the background compactor every compact_interval_s (0: on demand only),
    # reading at most compact_rate bytes per second.
    compact_dead_percent: int = 50
    compact_interval_s: int = 60
    compact_rate: int = 64 * MiB
    # Small sealed segments (flushes, stops, seal_after_s: a fleet node seals
    # up to 8,640 a day per tenant writing a trickle) are merged by the same
    # passes: a tenant's sealed segments under merge_below bytes, once it has
    # 4 (compactor.MERGE_MIN_SEGMENTS) of them, are copied into its open segment (their
    # objects then leave the bucket). None (unset): a quarter of segment_size;
    # 0: never merged. Read it through :attr:`merge_threshold`.
    merge_below: int | None = None
    # Segment files each worker keeps open for reads (the writer's sealed ones
    # among them): past it, the least recently read are closed and reopened
    # when next read. The writer also holds two per tenant with an open segment.
    max_open_segments: int = 4096
    # Plaintext of sealed and compressed blocks read recently, kept in each
    # worker process's memory (never on disk) so reads of hot blocks skip the
    # codec (engine/decoded.py); 0 turns it off.
    decoded_cache_bytes: int = 256 * MiB

    def __post_init__(self) -> None:
        self.validate()

    @property
    def seal_after(self) -> float:
        """Seconds after which an open segment's oldest unsealed record gets
        it sealed (0: never): ``seal_after_s``, or its default, which
        depends on ``fleet``."""
        if self.seal_after_s is not None:
            return self.seal_after_s
        return FLEET_SEAL_AFTER_S if self.fleet else 0.0

    def frame_size_of(self, tenant_frame_size: int) -> int:
        """The frame size new records of a tenant get (0: this store's)."""
        return tenant_frame_size or self.frame_size

    def validate(self) -> None:
        def need(ok: bool, name: str, value: object, what: str) -> None:
            if not ok:
                raise ConfigError(f"{name}={value!r}: {what}")

        need(1 * MiB <= self.segment_size <= 64 * GiB, "segment_size", self.segment_size, "must be 1 MiB to 64 GiB")
        need(valid_frame_size(self.frame_size), "frame_size", self.frame_size, FRAME_SIZE_RULE)
        need(1 <= self.max_block_size <= 4 * GiB, "max_block_size", self.max_block_size, "must be 1 B to 4 GiB")
        need(self.durability in ("fsync", "interval"), "durability", self.durability, "expected fsync or interval")
        need(1 <= self.sync_interval_ms <= 60_000, "sync_interval_ms", self.sync_interval_ms, "must be 1 to 60000")
        need(self.compression in COMPRESSIONS, "compression", self.compression, f"expected one of {COMPRESSIONS}")
        need(-7 <= self.zstd_level <= 22, "zstd_level", self.zstd_level, "must be -7 to 22")
        need(1 * MiB <= self.max_batch_bytes, "max_batch_bytes", self.max_batch_bytes, "must be at least 1 MiB")
        need(1 <= self.io_threads <= 256, "io_threads", self.io_threads, "must be 1 to 256")
        need(self.capacity >= 0, "capacity", self.capacity, "must be 0 (the whole filesystem) or a size")
        need(
            self.space_reserve == 0 or 1 * MiB <= self.space_reserve <= 64 * GiB,
            "space_reserve",
            self.space_reserve,
            "must be 0 (one segment) or 1 MiB to 64 GiB",
        )
        need(1 <= self.high_watermark <= 100, "high_watermark", self.high_watermark, "must be a percentage 1 to 100")
        need(
            1 <= self.low_watermark < self.high_watermark,
            "low_watermark",
            self.low_watermark,
            f"must be a percentage from 1 to below high_watermark ({self.high_watermark})",
        )
        need(
            self.default_durability in DURABILITY_CLASSES,
            "default_durability",
            self.default_durability,
            f"expected one of {', '.join(DURABILITY_CLASSES)}",
        )
        need(self.quota_eviction in QUOTA_EVICTION, "quota_eviction", self.quota_eviction, "expected lru or probation")
        need(self.s3_addressing in S3_ADDRESSING, "s3_addressing", self.s3_addressing, "expected auto, path or virtual")
        need(
            not self.s3_endpoint or self.s3_endpoint.startswith(("http://", "https://")),
            "s3_endpoint",
            self.s3_endpoint,
            "expected an http:// or https:// URL",
        )
        need(not (self.s3_bucket and self.tier_dir), "tier_dir", self.tier_dir, "set s3_bucket or tier_dir, not both")
        need(
            bool(self.s3_bucket or self.tier_dir) or not self.s3_readonly,
            "s3_readonly",
            self.s3_readonly,
            "needs s3_bucket or tier_dir",
        )
        need(
            1 <= self.s3_upload_concurrency <= 64,
            "s3_upload_concurrency",
            self.s3_upload_concurrency,
            "must be 1 to 64",
        )
        need(
            100 <= self.s3_read_timeout_ms <= 600_000,
            "s3_read_timeout_ms",
            self.s3_read_timeout_ms,
            "must be 100 to 600000",
        )
        need(1 <= self.s3_refresh_s <= 86_400, "s3_refresh_s", self.s3_refresh_s, "must be 1 to 86400")
        need(
            bool(self.s3_bucket or self.tier_dir) or not self.fleet, "fleet", self.fleet, "needs s3_bucket or tier_dir"
        )
        need(not (self.fleet and self.s3_readonly), "fleet", self.fleet, "a fleet node writes: not with s3_readonly")
        need(
            not self.node_id or NODE_ID.fullmatch(self.node_id) is not None,
            "node_id",
            self.node_id,
            "expected 1 to 64 characters of [a-z0-9-], starting with a letter or digit",
        )
        need(
            not self.advertise_url or self.advertise_url.startswith(("http://", "https://")),
            "advertise_url",
            self.advertise_url,
            "expected an http:// or https:// URL",
        )
        need(
            not self.fleet_etcd_url or self.fleet_etcd_url.startswith(("http://", "https://")),
            "fleet_etcd_url",
            self.fleet_etcd_url,
            "expected an http:// or https:// URL (etcd's v3 JSON gateway)",
        )
        need(0.1 <= self.fleet_heartbeat_s <= 60, "fleet_heartbeat_s", self.fleet_heartbeat_s, "must be 0.1 to 60")
        need(
            2 * self.fleet_heartbeat_s <= self.fleet_dead_after_s <= 600,
            "fleet_dead_after_s",
            self.fleet_dead_after_s,
            f"must be at least twice fleet_heartbeat_s ({self.fleet_heartbeat_s}) and at most 600",
        )
        need(0 <= self.fleet_handback_s <= 3600, "fleet_handback_s", self.fleet_handback_s, "must be 0 to 3600")
        need(
            self.seal_after_s is None or self.seal_after_s == 0 or 0.1 <= self.seal_after_s <= 86_400,
            "seal_after_s",
            self.seal_after_s,
            "must be 0 (off) or 0.1 to 86400 seconds",
        )
        need(
            not self.seal_after_s or bool(self.s3_bucket or self.tier_dir),
            "seal_after_s",
            self.seal_after_s,
            "needs s3_bucket or tier_dir: sealing early only bounds what is not yet in the object tier",
        )
        need(self.rehydrate_reads >= 0, "rehydrate_reads", self.rehydrate_reads, "must be 0 (never) or more")
        need(
            self.default_quota_bytes >= 0, "default_quota_bytes", self.default_quota_bytes, "must be 0 (none) or a size"
        )
        need(
            0 <= self.default_ttl_s <= 10 * 365 * 86_400,
            "default_ttl_s",
            self.default_ttl_s,
            "must be 0 (none) or seconds up to 10 years",
        )
        need(
            1 <= self.admission_keys <= 100_000_000,
            "admission_keys",
            self.admission_keys,
            "must be 1 to 100000000 (keys counted per tenant)",
        )
        need(1 <= self.default_qos_weight <= 1000, "default_qos_weight", self.default_qos_weight, "must be 1 to 1000")
        for name in ("default_read_bytes_per_s", "default_write_bytes_per_s", "default_requests_per_s"):
            need(0 <= getattr(self, name) <= 1 << 50, name, getattr(self, name), "must be 0 (no limit) or a rate")
        need(1 <= self.ttl_sweep_s <= 86_400, "ttl_sweep_s", self.ttl_sweep_s, "must be 1 to 86400")
        need(
            1 <= self.compact_dead_percent <= 100,
            "compact_dead_percent",
            self.compact_dead_percent,
            "must be a percentage 1 to 100",
        )
        need(
            0 <= self.compact_interval_s <= 86_400,
            "compact_interval_s",
            self.compact_interval_s,
            "must be 0 (on demand only) to 86400",
        )
        need(self.compact_rate >= 1 * MiB, "compact_rate", self.compact_rate, "must be at least 1 MiB (per second)")
        need(
            16 <= self.max_open_segments <= 1_000_000,
            "max_open_segments",
            self.max_open_segments,
            "must be 16 to 1000000 (files per worker)",
        )
        need(
            self.merge_below is None or 0 <= self.merge_below <= self.segment_size,
            "merge_below",
            self.merge_below,
            f"must be 0 (off) to segment_size ({self.segment_size})",
        )

    @classmethod
    def from_env(
        cls, data_dir: str | os.PathLike[str], env: Mapping[str, str] | None = None, **overrides: Any
    ) -> StoreConfig:
        """Defaults, then ``KVSTORE_<FIELD>`` variables from ``env``, then
        ``overrides`` (for tests and tools; the daemon and fsck load every
        source with :func:`kvstore.server_config.load`)."""
        values = env_values(os.environ if env is None else env, STORE_PARSERS, parse_field)
        for name, value in overrides.items():
            values[name] = parse_field(name, name, value)
        return cls(data_dir=Path(data_dir), **values)

    @property
    def merge_threshold(self) -> int:
        """Sealed segments under this many bytes are merged (0: never):
        ``merge_below``, or a quarter of ``segment_size``."""
        return self.segment_size // 4 if self.merge_below is None else self.merge_below

    def with_(self, **changes: Any) -> StoreConfig:
        """A copy with ``changes`` applied, parsed like environment values."""
        return replace(self, **{name: parse_field(name, name, value) for name, value in changes.items()})


Parser = Callable[[str, object], Any]  # (the name to show in errors, the raw value) -> the setting's value


def _choice(choices: tuple[str, ...]) -> Parser:
    return lambda label, value: parse_choice(label, value, choices)


# The storage engine's settings: one parser each (server_config.py has the
# daemon's in the same form; a setting without a parser does not exist).
STORE_PARSERS: dict[str, Parser] = {
    **dict.fromkeys(
        (
            "segment_size",
            "frame_size",
            "max_block_size",
            "max_batch_bytes",
            "capacity",
            "space_reserve",
            "default_quota_bytes",
            "default_read_bytes_per_s",
            "default_write_bytes_per_s",
            "compact_rate",
            "merge_below",
            "decoded_cache_bytes",
        ),
        parse_size,
    ),
    **dict.fromkeys(
        (
            "sync_interval_ms",
            "zstd_level",
            "io_threads",
            "high_watermark",
            "low_watermark",
            "s3_upload_concurrency",
            "s3_read_timeout_ms",
            "s3_refresh_s",
            "rehydrate_reads",
            "default_ttl_s",
            "admission_keys",
            "default_qos_weight",
            "default_requests_per_s",
            "ttl_sweep_s",
            "compact_dead_percent",
            "compact_interval_s",
            "max_open_segments",
        ),
        parse_int,
    ),
    **dict.fromkeys(
        (
            "s3_bucket",
            "s3_endpoint",
            "s3_prefix",
            "s3_region",
            "tier_dir",
            "node_id",
            "advertise_url",
            "fleet_etcd_url",
        ),
        parse_text,
    ),
    **dict.fromkeys(("s3_readonly", "discard_unknown_tenants", "fleet"), parse_bool),
    **dict.fromkeys(("fleet_heartbeat_s", "fleet_dead_after_s", "fleet_handback_s", "seal_after_s"), parse_float),
    "s3_addressing": _choice(S3_ADDRESSING),
    "default_durability": _choice(DURABILITY_CLASSES),
    "durability": _choice(("fsync", "interval")),
    "direct_io": _choice(("auto", "on", "off")),
    "quota_eviction": _choice(QUOTA_EVICTION),
    "compression": _choice(COMPRESSIONS),
}


def parse_field(label: str, name: str, value: object) -> Any:
    """The value of storage setting ``name`` from ``value`` (``label`` names
    it in errors: the TOML key, the variable or the flag)."""
    parser = STORE_PARSERS.get(name)
    if parser is None:
        raise ConfigError(f"{label}: unknown setting")
    return parser(label, value)


ENV_PREFIX = "KVSTORE_"


def env_values(
    env: Mapping[str, str], names: Iterable[str], parse: Callable[[str, str, object], Any]
) -> dict[str, Any]:
    """The settings among ``names`` that ``env`` sets (``KVSTORE_<NAME>``),
    parsed with ``parse(variable, name, text)``: the one reader of settings
    from the environment."""
    values: dict[str, Any] = {}
    for name in names:
        var = ENV_PREFIX + name.upper()
        if var in env:
            values[name] = parse(var, name, env[var])
    return values

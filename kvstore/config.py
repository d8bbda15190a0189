"""Store configuration: defaults, ``KVSTORE_*`` environment overrides, validation.

A bad value is refused with the setting's name and the value; nothing falls
back to a default silently.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, cast

from kvstore.codec import COMPRESSIONS, Compression
from kvstore.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
Durability = Literal["fsync", "interval"]

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


def parse_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in choices:
        return value
    raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")


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
    io_threads: int = max(4, 2 * (os.cpu_count() or 2))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, name: str, value: object, what: str) -> None:
            if not ok:
                raise ConfigError(f"{name}={value!r}: {what}")

        need(1 * MiB <= self.segment_size <= 64 * GiB, "segment_size", self.segment_size, "must be 1 MiB to 64 GiB")
        need(
            4 * KiB <= self.frame_size <= 64 * MiB and self.frame_size % (4 * KiB) == 0,
            "frame_size",
            self.frame_size,
            "must be a multiple of 4 KiB from 4 KiB to 64 MiB",
        )
        need(1 <= self.max_block_size <= 4 * GiB, "max_block_size", self.max_block_size, "must be 1 B to 4 GiB")
        need(self.durability in ("fsync", "interval"), "durability", self.durability, "expected fsync or interval")
        need(1 <= self.sync_interval_ms <= 60_000, "sync_interval_ms", self.sync_interval_ms, "must be 1 to 60000")
        need(self.compression in COMPRESSIONS, "compression", self.compression, f"expected one of {COMPRESSIONS}")
        need(-7 <= self.zstd_level <= 22, "zstd_level", self.zstd_level, "must be -7 to 22")
        need(1 * MiB <= self.max_batch_bytes, "max_batch_bytes", self.max_batch_bytes, "must be at least 1 MiB")
        need(1 <= self.io_threads <= 256, "io_threads", self.io_threads, "must be 1 to 256")

    @classmethod
    def from_env(
        cls, data_dir: str | os.PathLike[str], env: Mapping[str, str] | None = None, **overrides: Any
    ) -> StoreConfig:
        """Defaults, then ``KVSTORE_<FIELD>`` variables from ``env``, then ``overrides``."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "data_dir":
                continue
            var = "KVSTORE_" + f.name.upper()
            if var in env:
                values[f.name] = parse_field(var, f.name, env[var])
        for name, value in overrides.items():
            values[name] = parse_field(name, name, value)
        return cls(data_dir=Path(data_dir), **values)

    def with_(self, **changes: Any) -> StoreConfig:
        """A copy with ``changes`` applied, parsed like environment values."""
        return replace(self, **{name: parse_field(name, name, value) for name, value in changes.items()})


def parse_field(label: str, name: str, value: object) -> Any:
    if name in ("segment_size", "frame_size", "max_block_size", "max_batch_bytes"):
        return parse_size(label, value)
    if name in ("sync_interval_ms", "zstd_level", "io_threads"):
        return parse_int(label, value)
    if name == "durability":
        return cast(Durability, parse_choice(label, value, ("fsync", "interval")))
    if name == "compression":
        return parse_choice(label, value, COMPRESSIONS)
    raise ConfigError(f"{label}: unknown setting")

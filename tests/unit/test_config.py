"""config.py and names.py: bad values are refused with the name and the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import MiB, StoreConfig, parse_size
from kvstore.errors import ConfigError, InvalidKey, InvalidTenant
from kvstore.names import validate_key, validate_tenant


def test_defaults(tmp_path: Path) -> None:
    c = StoreConfig.from_env(tmp_path, env={})
    assert (c.segment_size, c.frame_size, c.max_block_size) == (256 * MiB, 1 * MiB, 64 * MiB)
    assert c.durability == "fsync" and c.compression == "zstd-bp2"


def test_env_overrides(tmp_path: Path) -> None:
    c = StoreConfig.from_env(
        tmp_path,
        env={"KVSTORE_SEGMENT_SIZE": "64MiB", "KVSTORE_DURABILITY": "interval", "KVSTORE_FRAME_SIZE": "262144"},
    )
    assert (c.segment_size, c.durability, c.frame_size) == (64 * MiB, "interval", 256 * 1024)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KVSTORE_SEGMENT_SIZE", "lots"),
        ("KVSTORE_SEGMENT_SIZE", "10"),
        ("KVSTORE_FRAME_SIZE", "1000"),
        ("KVSTORE_DURABILITY", "sometimes"),
        ("KVSTORE_COMPRESSION", "lz4"),
        ("KVSTORE_ZSTD_LEVEL", "x"),
    ],
)
def test_bad_values_name_the_setting(tmp_path: Path, var: str, value: str) -> None:
    with pytest.raises(ConfigError) as e:
        StoreConfig.from_env(tmp_path, env={var: value})
    field = var.removeprefix("KVSTORE_").lower()
    assert field in str(e.value).lower() and value in str(e.value)


def test_parse_size() -> None:
    assert parse_size("x", "4k") == 4096
    assert parse_size("x", "2 GiB") == 2 << 30
    assert parse_size("x", 17) == 17
    with pytest.raises(ConfigError):
        parse_size("x", True)


@pytest.mark.parametrize("key", ["a", "A-z_0.9~:@=+", "k" * 256])
def test_valid_keys(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize(
    ("key", "why"),
    [("", "empty"), ("k" * 257, "257"), ("a/b", "'/'"), ("a b", "' '"), ("ключ", "allowed"), ("a\x00", "allowed")],
)
def test_invalid_keys(key: str, why: str) -> None:
    with pytest.raises(InvalidKey, match=why):
        validate_key(key)
    with pytest.raises(InvalidKey, match="string"):
        validate_key(b"bytes")


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "..", "x" * 65, "a b"])
def test_invalid_tenants(name: str) -> None:
    with pytest.raises(InvalidTenant):
        validate_tenant(name)


def test_every_setting_has_one_parser_and_one_environment_reader() -> None:
    """One schema: each storage setting has exactly one parser in
    config.STORE_PARSERS, the daemon's in server_config, and both are read
    from the environment by config.env_values."""
    from dataclasses import fields

    from kvstore.config import STORE_PARSERS, StoreConfig, env_values, parse_field
    from kvstore.server_config import SETTINGS, load

    assert set(STORE_PARSERS) == {f.name for f in fields(StoreConfig)} - {"data_dir"}
    assert set(STORE_PARSERS) <= set(SETTINGS)
    env = {"KVSTORE_SEGMENT_SIZE": "2MiB", "KVSTORE_TTL_SWEEP_S": "5", "KVSTORE_WORKERS": "3"}
    assert env_values(env, STORE_PARSERS, parse_field) == {"segment_size": 2 << 20, "ttl_sweep_s": 5}
    cfg = load(None, env=env, flags={"data_dir": "/tmp/x"})
    assert (cfg.workers, cfg.store.segment_size, cfg.store.ttl_sweep_s) == (3, 2 << 20, 5)
    assert StoreConfig.from_env("/tmp/x", env=env).segment_size == 2 << 20

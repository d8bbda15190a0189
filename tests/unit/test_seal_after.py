"""``seal_after_s`` (issue 40, bounded loss): off on a single node unless
set, 10 s on a fleet node unless set, 0 turns it off anywhere; a bad value
is refused with the setting's name and value, from every source."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import FLEET_SEAL_AFTER_S, StoreConfig
from kvstore.errors import ConfigError
from kvstore.server_config import load

BUCKET = {"s3_bucket": "b"}


def cfg(tmp_path: Path, env: dict[str, str] | None = None, **changes: object) -> StoreConfig:
    return StoreConfig.from_env(tmp_path, env=env or {}, **changes)


def test_off_on_a_single_node_unless_set(tmp_path: Path) -> None:
    assert cfg(tmp_path).seal_after == 0
    assert cfg(tmp_path, **BUCKET).seal_after == 0
    assert cfg(tmp_path, **BUCKET, seal_after_s="2.5").seal_after == 2.5


def test_on_by_default_on_a_fleet_node(tmp_path: Path) -> None:
    assert FLEET_SEAL_AFTER_S == 10
    assert cfg(tmp_path, **BUCKET, fleet=True).seal_after == 10
    assert cfg(tmp_path, **BUCKET, fleet=True, seal_after_s=3).seal_after == 3
    assert cfg(tmp_path, **BUCKET, fleet=True, seal_after_s=0).seal_after == 0  # off, explicitly


def test_from_the_environment_and_the_settings_file(tmp_path: Path) -> None:
    env = {"KVSTORE_S3_BUCKET": "b", "KVSTORE_SEAL_AFTER_S": "0.5"}
    assert cfg(tmp_path, env).seal_after == 0.5
    toml = tmp_path / "kvstore.toml"
    toml.write_text('s3_bucket = "b"\nfleet = true\nseal_after_s = 30\n')
    assert load(toml, env={}).store.seal_after == 30
    toml.write_text('s3_bucket = "b"\nfleet = true\n')
    assert load(toml, env={}).store.seal_after == 10


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("-1", "must be 0 (off) or 0.1 to 86400 seconds"),
        ("0.05", "must be 0 (off) or 0.1 to 86400 seconds"),
        ("86401", "must be 0 (off) or 0.1 to 86400 seconds"),
        ("nan", "must be 0 (off) or 0.1 to 86400 seconds"),
        ("inf", "must be 0 (off) or 0.1 to 86400 seconds"),
        ("10s", "expected a number"),
    ],
)
def test_bad_values_name_the_setting(tmp_path: Path, value: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        cfg(tmp_path, {"KVSTORE_S3_BUCKET": "b", "KVSTORE_SEAL_AFTER_S": value})
    assert "SEAL_AFTER_S" in str(e.value).upper() and value in str(e.value) and why in str(e.value)


def test_needs_an_object_tier(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"seal_after_s=10\.0: needs s3_bucket or tier_dir"):
        cfg(tmp_path, seal_after_s=10)
    assert cfg(tmp_path, seal_after_s=0).seal_after == 0  # off needs nothing
    assert cfg(tmp_path, tier_dir=str(tmp_path / "g4"), seal_after_s=10).seal_after == 10

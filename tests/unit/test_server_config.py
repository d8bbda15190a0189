"""server_config's loader, as operators meet it: an error names the one bad
value and why; where each setting came from is known (``kvstore config``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.server_config import SETTINGS, Source, is_size, load, load_with_sources, setting_value


def test_a_bad_port_listed_every_address() -> None:
    """--listen 127.0.0.1:99999 beside good addresses was refused with the
    whole list and "expected HOST:PORT or unix:PATH": not which one, nor why.
    Now the message names the one address and what is wrong with it."""
    flags = {"listen": ["127.0.0.1:8420", "127.0.0.1:99999", "unix:/run/kv.sock"]}
    with pytest.raises(ConfigError) as e:
        load(None, env={}, flags=flags)
    assert str(e.value) == "--listen='127.0.0.1:99999': the port 99999 is out of range (0-65535)"
    env = {"KVSTORE_LISTEN": "127.0.0.1:1, [::1]:http"}
    with pytest.raises(ConfigError) as e:
        load(None, env=env)
    assert str(e.value) == "KVSTORE_LISTEN='[::1]:http': the port 'http' is not a number (0-65535)"
    with pytest.raises(ConfigError, match=r"^--listen='localhost': expected HOST:PORT or unix:PATH"):
        load(None, env={}, flags={"listen": ["127.0.0.1:1", "localhost"]})
    with pytest.raises(ConfigError, match=r"^--s3-gateway-listen='127.0.0.1:70000': the port 70000 is out of range"):
        load(None, env={}, flags={"s3_gateway_listen": "127.0.0.1:70000"})
    assert load(None, env={}, flags={"listen": ["127.0.0.1:0", "[::1]:65535"]}).listen == "127.0.0.1:0,[::1]:65535"


def test_every_setting_has_a_source(tmp_path: Path) -> None:
    """defaults < file < environment < flags, and the map says which won."""
    toml = tmp_path / "kvstore.toml"
    toml.write_text('durability = "interval"\nworkers = 3\nlog_format = "json"\n')
    env = {"KVSTORE_WORKERS": "2", "KVSTORE_ADMIN_TOKEN": "x" * 40}
    cfg, sources = load_with_sources(toml, env, {"log_format": "text", "data_dir": "/srv/kv", "listen": None})
    assert set(sources) == set(SETTINGS)
    assert sources["durability"] == Source("file", str(toml)) and cfg.store.durability == "interval"
    assert sources["workers"] == Source("environment", "KVSTORE_WORKERS") and cfg.workers == 2
    assert sources["log_format"] == Source("flag", "--log-format") and cfg.log_format == "text"
    assert sources["data_dir"] == Source("flag", "--data-dir") and setting_value(cfg, "data_dir") == "/srv/kv"
    assert sources["admin_token"] == Source("environment", "KVSTORE_ADMIN_TOKEN")
    assert sources["listen"] == Source("default") and str(sources["listen"]) == "default"
    assert str(sources["workers"]) == "environment KVSTORE_WORKERS"
    assert load(toml, env, {"log_format": "text", "data_dir": "/srv/kv"}) == cfg  # load: the same loader


def test_setting_values_and_sizes() -> None:
    cfg = load(None, env={}, flags={"segment_size": "4MiB", "max_buffered_body_bytes": "2GiB"})
    assert setting_value(cfg, "segment_size") == 4 << 20 and setting_value(cfg, "listen") == "127.0.0.1:8420"
    assert is_size("segment_size") and is_size("max_buffered_body_bytes") and not is_size("workers")
    for name in SETTINGS:
        setting_value(cfg, name)  # every setting has a value to show

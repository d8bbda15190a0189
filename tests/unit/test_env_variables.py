"""KVSTORE_* variables (issue 24, item 7): a misspelled one stops start-up
with the closest setting's name, as a misspelled TOML key does; every
setting (the config classes' fields, whatever they are) and every variable
another program of this repository reads is accepted."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.server_config import OTHER_VARIABLES, SETTINGS, ServerConfig, check_env, is_service_link, load

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["kvstore", "clients", "bench", "deploy", "tests", "server.py", "docs", "README.md"]
# The tests of this check, which name misspelled variables on purpose.
MISSPELLING = {
    ROOT / "tests" / "unit" / "test_env_variables.py",
    ROOT / "tests" / "http" / "test_daemon_edges.py",
    ROOT / "tests" / "integration" / "test_fsck.py",
    ROOT / "tests" / "unit" / "test_config_command.py",
}


def test_misspelled_variable_was_ignored_silently() -> None:
    """KVSTORE_DURABLITY=interval was ignored: the store ran with fsync."""
    with pytest.raises(ConfigError, match="'KVSTORE_DURABLITY' is not a setting; did you mean KVSTORE_DURABILITY"):
        load(None, env={"KVSTORE_DURABLITY": "interval"})
    with pytest.raises(ConfigError, match="did you mean KVSTORE_DURABILITY"):
        load(None, env={"KVSTORE_durability": "interval"})  # a variable's name is in capitals
    with pytest.raises(ConfigError, match=r"deploy/kvstore\.toml"):
        load(None, env={"KVSTORE_XYZZY": "1"})  # nothing close: where the settings are listed
    assert load(None, env={"KVSTORE_DURABILITY": "interval"}).store.durability == "interval"


def test_every_field_of_the_config_classes_is_a_variable() -> None:
    """Derived from the dataclasses: a field added to StoreConfig or
    ServerConfig is a variable without a list to keep."""
    names = {f.name for f in fields(StoreConfig)} | {f.name for f in fields(ServerConfig)} - {"store"}
    assert names <= set(SETTINGS)
    check_env({"KVSTORE_" + name.upper(): "x" for name in names})


def test_every_kvstore_variable_the_repository_names_is_accepted() -> None:
    """Grep the repository: each KVSTORE_* name is a setting or one of the
    other programs' variables (client, tests, bench), so that the harness
    that passes its KVSTORE_* variables on to a daemon is not refused."""
    found: set[str] = set()
    for top in SCANNED:
        path = ROOT / top
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            if file.suffix in (".pyc", ".bin", ".so", ".sqlite3") or "__pycache__" in file.parts or file in MISSPELLING:
                continue
            try:
                text = file.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            found |= set(re.findall(r"\bKVSTORE_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert "KVSTORE_ADMIN_TOKEN" in found and "KVSTORE_TOKEN" in found  # the scan sees the repository
    check_env(dict.fromkeys(found, "x"))
    assert not {v for v in OTHER_VARIABLES if v.removeprefix("KVSTORE_").lower() in SETTINGS}


def test_unknown_toml_key_names_the_closest_setting(tmp_path: Path) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text('durablity = "interval"\n')
    with pytest.raises(ConfigError, match="unknown key 'durablity'; did you mean 'durability'"):
        load(toml, env={})


def test_kubernetes_service_links_do_not_stop_the_daemon() -> None:
    """Used to be: a Service named "kvstore" gave every pod KVSTORE_PORT,
    KVSTORE_SERVICE_HOST, KVSTORE_PORT_8420_TCP...; each was refused as an
    unknown setting and every pod exited (rc 2). These are the variables
    Kubernetes sets for Services "kvstore" (a port named "http") and
    "kvstore-fleet"."""
    env = {
        "KVSTORE_SERVICE_HOST": "10.96.0.12",
        "KVSTORE_SERVICE_PORT": "8420",
        "KVSTORE_SERVICE_PORT_HTTP": "8420",
        "KVSTORE_PORT": "tcp://10.96.0.12:8420",
        "KVSTORE_PORT_8420_TCP": "tcp://10.96.0.12:8420",
        "KVSTORE_PORT_8420_TCP_PROTO": "tcp",
        "KVSTORE_PORT_8420_TCP_PORT": "8420",
        "KVSTORE_PORT_8420_TCP_ADDR": "10.96.0.12",
        "KVSTORE_FLEET_SERVICE_HOST": "10.96.0.13",
        "KVSTORE_FLEET_PORT_8420_TCP_ADDR": "10.96.0.13",
        "KVSTORE_FLEET_PORT_8421_UDP": "udp://10.96.0.13:8421",
    }
    cfg = load(None, env={**env, "KVSTORE_SEGMENT_SIZE": "1MiB"})
    assert cfg.store.segment_size == 1 << 20 and cfg.listen == "127.0.0.1:8420"  # nothing taken from them
    # A misspelled setting is still refused beside them.
    with pytest.raises(ConfigError, match="did you mean KVSTORE_SEGMENT_SIZE"):
        load(None, env={**env, "KVSTORE_SEGMENT_SIZ": "1MiB"})
    assert is_service_link("KVSTORE_PORT") and not is_service_link("KVSTORE_SEGMENT_SIZE")

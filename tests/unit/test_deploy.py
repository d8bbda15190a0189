"""deploy/: the example configuration, the env file and the systemd unit agree with the code."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from kvstore.server_config import SECRETS, SETTINGS, ServerConfig, load

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
TOML = DEPLOY / "kvstore.toml"
UNIT = DEPLOY / "kvstore.service"
ENV_EXAMPLE = DEPLOY / "kvstore.env.example"

PUBLIC = [name for name in SETTINGS if name not in SECRETS]
# "# name = value": a setting commented out at its default. "# e.g. name = value":
# a setting unset by default (or machine-dependent), with an example value.
COMMENTED = re.compile(r"^# (?P<name>[a-z0-9_]+) = (?P<value>.+)$", re.MULTILINE)
EXAMPLE = re.compile(r"^# e\.g\. (?P<name>[a-z0-9_]+) = (?P<value>.+)$", re.MULTILINE)
ACTIVE = re.compile(r"^(?P<name>[a-z0-9_]+) = (?P<value>.+)$", re.MULTILINE)


def defaults() -> ServerConfig:
    """The configuration with nothing set: the dataclasses' defaults, data_dir as load() defaults it."""
    return ServerConfig(store=StoreConfig(data_dir=Path("data")))


def names(pattern: re.Pattern[str], text: str) -> list[str]:
    return [m["name"] for m in pattern.finditer(text)]


# --- deploy/kvstore.toml -------------------------------------------------------------


def test_example_toml_loads_with_defaults() -> None:
    # The settings it sets explicitly are pinned at today's defaults.
    assert load(TOML, env={}) == defaults()


def test_example_toml_lists_every_setting_once() -> None:
    text = TOML.read_text()
    listed = names(ACTIVE, text) + names(COMMENTED, text) + names(EXAMPLE, text)
    assert sorted(listed) == sorted(PUBLIC), "each setting but the secrets once, as name = value (commented or not)"
    for secret in SECRETS:
        assert not re.search(rf"^(# )?(e\.g\. )?{secret} =", text, re.MULTILINE), secret


def test_example_toml_pins_a_few_settings() -> None:
    active = names(ACTIVE, TOML.read_text())
    assert 0 < len(active) <= 5 and set(active) <= set(PUBLIC)


def test_uncommenting_every_setting_yields_the_defaults(tmp_path: Path) -> None:
    text = TOML.read_text()
    uncommented = COMMENTED.sub(r"\g<name> = \g<value>", text)
    assert len(names(ACTIVE, uncommented)) == len(names(ACTIVE, text)) + len(names(COMMENTED, text))
    path = tmp_path / "all.toml"
    path.write_text(uncommented)
    assert load(path, env={}) == defaults()


def test_examples_are_the_unset_and_machine_dependent_settings(tmp_path: Path) -> None:
    text = TOML.read_text()
    server_none = {f.name for f in fields(ServerConfig) if f.default is None} - SECRETS
    store_unset = {f.name for f in fields(StoreConfig) if f.default == ""}
    assert store_unset == {
        "s3_bucket",
        "s3_endpoint",
        "s3_prefix",
        "s3_region",
        "tier_dir",
        "node_id",
        "advertise_url",
        "fleet_etcd_url",
    }
    # Unset, its default depending on another setting (seal_after_s: on a fleet node, 10 s;
    # merge_below: a quarter of segment_size).
    store_depends = {f.name for f in fields(StoreConfig) if f.default is None}
    assert store_depends == {"seal_after_s", "merge_below"}
    assert set(names(EXAMPLE, text)) == server_none | store_unset | store_depends | {"io_threads"}
    # The examples are valid values too (tier_dir on its own: it excludes s3_bucket).
    alone = re.search(r"^# e\.g\. (tier_dir = .+)$", text, re.MULTILINE)
    assert alone is not None
    (tmp_path / "tier_dir.toml").write_text(alone.group(1) + "\n")
    assert load(tmp_path / "tier_dir.toml", env={}).store.tier_dir
    path = tmp_path / "examples.toml"
    path.write_text(EXAMPLE.sub(r"\g<name> = \g<value>", text.replace(alone.group(0), "")))
    cfg = load(path, env={})
    assert cfg.tls_cert and cfg.tls_key and cfg.master_key_file and cfg.admin_token_file
    assert cfg.store.io_threads == 16
    assert cfg.store.s3_bucket and cfg.store.s3_endpoint.startswith("https://")


def unit_directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of every assignment in a unit file, in order; keys may repeat."""
    out: list[tuple[str, str, str]] = []
    section = ""
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {line!r}"
        out.append((section, key.strip(), value.strip()))
    return out


def service(key: str) -> list[str]:
    return [v for s, k, v in unit_directives(UNIT.read_text()) if s == "Service" and k == key]


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, value
    return int(m[1]) * (60 if m[2] == "min" else 1)


def test_toml_shutdown_timeout_fits_in_the_units_stop_timeout() -> None:
    # SIGKILL at TimeoutStopSec= must not cut the drain short.
    (stop,) = service("TimeoutStopSec")
    assert load(TOML, env={}).shutdown_timeout_s + 10 <= seconds(stop)


# --- deploy/kvstore.env.example ------------------------------------------------------


def env_file(text: str) -> dict[str, str]:
    pairs = (line.partition("=") for line in text.splitlines() if line.strip() and not line.startswith("#"))
    return {k.strip(): v.strip() for k, _, v in pairs}


def test_env_example_gives_the_secrets() -> None:
    env = env_file(ENV_EXAMPLE.read_text())
    assert set(env) == {"KVSTORE_ADMIN_TOKEN", "KVSTORE_MASTER_KEY_FILE"}
    cfg = load(TOML, env=env)
    assert cfg.master_key_file == "/etc/kvstore/master.key"
    assert cfg.admin_secret() == env["KVSTORE_ADMIN_TOKEN"]


def test_env_example_names_only_real_settings() -> None:
    text = ENV_EXAMPLE.read_text()
    for var in re.findall(r"\bKVSTORE_[A-Z_]+", text):
        assert var.removeprefix("KVSTORE_").lower() in SETTINGS, var
    # Its commented overrides are valid values as well.
    uncommented = env_file(re.sub(r"^#(KVSTORE_)", r"\1", text, flags=re.MULTILINE))
    assert len(uncommented) > 2
    load(TOML, env=uncommented)


# --- deploy/kvstore.service: content -------------------------------------------------

EXPECTED = {
    "Type": "notify",
    "NotifyAccess": "main",
    "WatchdogSec": "30s",
    "User": "kvstore",
    "Group": "kvstore",
    "StateDirectory": "kvstore",
    "ConfigurationDirectory": "kvstore",
    "EnvironmentFile": "/etc/kvstore/kvstore.env",
    "ExecStart": "/opt/kvstore/.venv/bin/kvstore serve --config /etc/kvstore/kvstore.toml --data-dir /var/lib/kvstore",
    "ExecReload": "/bin/kill -HUP $MAINPID",
    "RuntimeDirectory": "kvstore",
    "RuntimeDirectoryMode": "0755",
    "Restart": "on-failure",
    "TimeoutStopSec": "60",
    "KillSignal": "SIGTERM",
    # Used to be unset (control-group: every worker signalled at once, and 1 stop
    # in 3 ended "failed"), and a refused configuration restarted five times.
    "KillMode": "mixed",
    "RestartPreventExitStatus": "2",
    "LimitNOFILE": "1048576",
    "UMask": "0077",
    "ReadWritePaths": "/var/lib/kvstore",
    # hardening
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "SystemCallArchitectures": "native",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
}


@pytest.mark.parametrize(("key", "value"), EXPECTED.items(), ids=list(EXPECTED))
def test_unit_sets(key: str, value: str) -> None:
    assert service(key) == [value]


def test_unit_filters_system_calls() -> None:
    # Used to be: ~@privileged forbade the chown that unix_socket_group makes.
    assert service("SystemCallFilter") == ["@system-service", "~@privileged", "@chown"]


def test_the_unit_lets_the_daemon_write_where_its_settings_say() -> None:
    # Used to be: ProtectSystem=strict and no RuntimeDirectory=, so the
    # documented unix:/run/kvstore/kvstore.sock could not be created.
    toml = TOML.read_text()
    assert "unix:/run/kvstore/kvstore.sock" in toml
    (runtime,) = service("RuntimeDirectory")
    assert Path("/run", runtime) == Path("/run/kvstore/kvstore.sock").parent
    text = UNIT.read_text()
    assert "tier_dir" in text and re.search(r"^#ReadWritePaths=\S+", text, re.MULTILINE)


def test_unit_is_installable() -> None:
    sections = {s for s, _, _ in unit_directives(UNIT.read_text())}
    assert sections == {"Unit", "Service", "Install"}
    assert ("Install", "WantedBy", "multi-user.target") in unit_directives(UNIT.read_text())


def test_unit_flags_are_settings() -> None:
    (exec_start,) = service("ExecStart")
    flags = [a for a in exec_start.split() if a.startswith("--")]
    assert flags == ["--config", "--data-dir"]
    assert "data_dir" in SETTINGS  # --config is kvstore serve's own flag


# --- deploy/kvstore.service: systemd-analyze -------------------------------------------

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed: cannot check the unit with systemd"
)


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def checkable_unit(tmp_path: Path, text: str | None = None, keep_user: bool = False) -> Path:
    """A copy of the unit that systemd-analyze can check on this machine.

    ExecStart= runs this checkout's server.py with this interpreter (verify
    fails on an ExecStart= binary that does not exist, and /opt/kvstore is not
    here). User=/Group= are dropped unless the kvstore user exists here: it is
    created at install time (useradd --system), and some systemd versions
    resolve the user when they check a unit.
    """
    text = UNIT.read_text() if text is None else text
    python, server = sys.executable, str(REPO / "server.py")
    exec_start = " ".join(f'"{a}"' if re.search(r"\s", a) else a for a in (python, server))
    text = re.sub(r"^ExecStart=\S+ serve", lambda _: f"ExecStart={exec_start}", text, count=1, flags=re.MULTILINE)
    if not keep_user and not user_exists("kvstore"):
        text = re.sub(r"^(User|Group)=.*\n", "", text, flags=re.MULTILINE)
    directory = tmp_path / "unit"
    directory.mkdir(exist_ok=True)
    path = directory / "kvstore.service"
    path.write_text(text)
    return path


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    env = {**os.environ, "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "", "SYSTEMD_LOG_COLOR": "0"}
    return subprocess.run(
        [SYSTEMD_ANALYZE, "--no-pager", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=env,
        timeout=60,
        check=False,
    )


def unit_problems(path: Path) -> list[str]:
    """What `systemd-analyze verify` finds wrong with the unit at ``path``.

    verify exits 0 on many real errors (an unknown directive, a value that does
    not parse: systemd logs them and ignores the line), so any message naming
    the unit counts as a problem, as does a non-zero exit. --man=false: the
    check is of the unit, not of which man pages this machine has.
    """
    r = analyze("verify", "--man=false", str(path))
    lines = [line for line in (r.stdout + r.stderr).splitlines() if path.name in line]
    if r.returncode != 0:
        lines.append(f"exit status {r.returncode}: {r.stdout}{r.stderr}")
    return lines


@needs_systemd_analyze
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    assert unit_problems(checkable_unit(tmp_path)) == []


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("ProtectSystem=strict", "ProtectSytem=strict"),  # misspelled directive
        ("Type=notify", "Type=notifyy"),  # bad value
        ("WatchdogSec=30s", "WatchdogSec=thirty"),  # bad time span
        ("[Service]", "[Servce]"),  # misspelled section
        ("ExecStart=", "ExecStart=/nonexistent/kvstore/python "),  # a binary that is not there
    ],
    ids=["directive", "value", "timespan", "section", "binary"],
)
def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path: Path, good: str, bad: str) -> None:
    # The check above would pass a broken unit if it only looked at verify's exit status.
    path = checkable_unit(tmp_path)
    broken, n = re.subn("^" + re.escape(good), bad, path.read_text(), count=1, flags=re.MULTILINE)
    assert n == 1
    path.write_text(broken)
    assert unit_problems(path) != []


@needs_systemd_analyze
def test_systemd_analyze_security(tmp_path: Path) -> None:
    path = checkable_unit(tmp_path, keep_user=True)  # offline analysis: the user need not exist
    r = analyze("security", "--offline=true", str(path))
    if r.returncode != 0 and ("offline" in r.stderr or "Unknown" in r.stderr or "unrecognized" in r.stderr):
        pytest.skip(f"this systemd-analyze cannot analyze a unit file offline: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", r.stdout)
    assert m, r.stdout[-2000:]
    level, verdict = float(m[1]), m[2]
    print(f"systemd-analyze security: exposure {level} {verdict}")
    # 0 (locked down) to 10 (exposed); the hardening above gives "OK" (below 4.5 or so).
    assert level < 4.0 and verdict == "OK", r.stdout[-4000:]

"""The daemon's configuration: defaults < TOML file < ``KVSTORE_*`` env < flags.

Every setting has one flat name, used as the TOML key, as the environment
variable ``KVSTORE_<NAME>`` and as the flag ``--<name-with-dashes>``. An
unknown TOML key, an unknown ``KVSTORE_*`` variable (other than those of
:data:`OTHER_VARIABLES`) or a bad value stops start-up with the name and
the value, and the closest setting's name for a misspelling; nothing falls
back to a default silently. ``deploy/kvstore.toml`` lists every setting with
its default.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from kvstore.config import (
    ENV_PREFIX,
    STORE_PARSERS,
    StoreConfig,
    env_values,
    parse_bool,
    parse_choice,
    parse_field,
    parse_int,
    parse_size,
)
from kvstore.errors import ConfigError
from kvstore.logs import FORMATS as LOG_FORMATS

DEFAULT_PORT = 8420


def _str(name: str, value: object) -> str:
    if isinstance(value, str) and value:
        return value
    raise ConfigError(f"{name}={value!r}: expected a non-empty string")


UNIX = "unix:"
SUN_PATH_MAX = 107  # bytes of a unix socket's path (sun_path, with its NUL)


def _listen(name: str, value: object) -> str:
    """One or more addresses (a list, or a comma-separated string): HOST:PORT
    or unix:PATH. Kept as the comma-separated text. A bad one is refused
    naming that address alone and what is wrong with it."""
    items = [_str(name, v) for v in value] if isinstance(value, list | tuple) else _str(name, value).split(",")
    out: list[str] = []
    for raw in items:
        text = raw.strip()
        if text.startswith(UNIX):
            path = text[len(UNIX) :]
            if not path or "\0" in path or len(os.fsencode(path)) > SUN_PATH_MAX:
                raise ConfigError(f"{name}={text!r}: needs a path of 1 to {SUN_PATH_MAX} bytes after 'unix:'")
        else:
            host, sep, port = text.rpartition(":")
            if not sep or not host or not port:
                raise ConfigError(f"{name}={text!r}: expected HOST:PORT or unix:PATH, such as 127.0.0.1:{DEFAULT_PORT}")
            if not port.isdigit():
                raise ConfigError(f"{name}={text!r}: the port {port!r} is not a number (0-65535)")
            if int(port) > 65535:
                raise ConfigError(f"{name}={text!r}: the port {int(port)} is out of range (0-65535)")
        if text in out:
            raise ConfigError(f"{name}={text!r} is given twice")
        out.append(text)
    return ",".join(out)


def _tcp_address(name: str, value: object) -> str:
    text = _listen(name, value)
    if "," in text or text.startswith(UNIX):
        raise ConfigError(f"{name}={value!r}: expected one HOST:PORT, such as 127.0.0.1:8421")
    return text


def _region(name: str, value: object) -> str:
    text = _str(name, value)
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", text):
        raise ConfigError(f"{name}={value!r}: expected a region name such as us-east-1")
    return text


def _domain(name: str, value: object) -> str:
    text = _str(name, value).lower().strip(".")
    if not re.fullmatch(r"[a-z0-9]([a-z0-9.\-]{0,251}[a-z0-9])?", text):
        raise ConfigError(f"{name}={value!r}: expected a DNS domain such as s3.example.internal")
    return text


def _mode(name: str, value: object) -> int:
    """Permission bits: a string in octal ("0660"), or TOML's own octal integer (0o660)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0o777:
        return value
    text = value.removeprefix("0o") if isinstance(value, str) else ""
    if not text.isdigit() or any(c > "7" for c in text) or int(text, 8) > 0o777:
        raise ConfigError(f"{name}={value!r}: expected permission bits in octal, such as 0660")
    return int(text, 8)


def _positive(name: str, value: object) -> int:
    n = parse_int(name, value)
    if n < 1:
        raise ConfigError(f"{name}={value!r}: expected a positive integer")
    return n


def _wait_ms(name: str, value: object) -> int:
    n = parse_int(name, value)
    if not 0 <= n <= 600_000:
        raise ConfigError(f"{name}={value!r}: expected milliseconds, 0 (never wait) to 600000")
    return n


AUTO: Final = "auto"


def _workers(name: str, value: object) -> int | Literal["auto"]:
    """A positive number of processes, or "auto" (kvstore/workers.py)."""
    if value == AUTO:
        return AUTO
    try:
        return _positive(name, value)
    except ConfigError:
        raise ConfigError(f"{name}={value!r}: expected a positive integer or {AUTO!r}") from None


def _zmq_endpoint(name: str, value: object) -> str:
    text = _str(name, value)
    if not text.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{name}={value!r}: expected a ZMQ endpoint such as tcp://127.0.0.1:5557 or ipc:///run/x")
    return text


def _log_level(name: str, value: object) -> str:
    return parse_choice(name, value, ("debug", "info", "warning", "error"))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Settings of the daemon; ``store`` holds the storage engine's."""

    store: StoreConfig
    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    # Processes sharing the port; "auto" is resolved at start-up (kvstore/workers.py),
    # after which ``worker_count`` is the number.
    workers: int | Literal["auto"] = AUTO
    admin_token: str | None = field(default=None, repr=False)
    admin_token_file: str | None = None
    # GET /metrics: a bearer token it requires (unset: none), and whether its
    # series carry tenants' names (false: summed over tenants, no tenant label).
    metrics_token: str | None = field(default=None, repr=False)
    metrics_token_file: str | None = None
    metrics_tenant_labels: bool = True
    master_key_file: str | None = None
    master_key: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    max_lookup_keys: int = 4096
    max_batch_keys: int = 1024
    max_concurrency: int = 512
    max_buffered_body_bytes: int = 1 << 30
    request_timeout_s: int = 60
    keepalive_timeout_s: int = 75
    shutdown_timeout_s: int = 30
    log_level: str = "info"
    log_format: str = "text"  # or "json": one object a line (kvstore/logs.py)
    unix_socket_mode: int = 0o660
    unix_socket_group: str | None = None
    sendfile: bool = True
    # GET/HEAD of a block answered from the connection's bytes, without the
    # framework, where the request allows (kvstore/transport/http/fastlane.py).
    fast_lane: bool = True
    # QoS between tenants (kvstore/qos/): how long a request over its
    # tenant's limit may wait before it is answered 429 rate_limited, and how
    # many bulk transfers a worker moves at once (past them, tenants queue
    # and take turns by weight).
    qos_max_wait_ms: int = 1000
    qos_transfers_per_worker: int = 4
    plan_paths: bool = False
    nixl: bool = False
    nixl_backend: str = "UCX"
    nixl_staging_bytes: int = 256 << 20
    nixl_lease_s: int = 30
    nixl_devices: str = "auto"
    events_zmq: str | None = None  # a ZMQ PUB endpoint (tcp://HOST:PORT, ipc://PATH): events in vLLM's format
    events_zmq_replay: str | None = None  # a ZMQ ROUTER endpoint replaying the backlog from a sequence
    events_encoding: str = "map"  # vLLM's current tagged-map events, or "array" (vLLM before 0.10)
    events_backlog: int = 10_000  # events kept for SSE resumption and ZMQ replay
    events_queue: int = 10_000  # events a subscriber may fall behind by before it loses some (a gap)
    events_medium_local: str = "STORAGE"  # the medium of events about blocks on local disk
    events_medium_object: str = "OBJECT_STORE"  # and about blocks only in the object tier
    s3_gateway_listen: str | None = None  # HOST:PORT of the S3-compatible gateway; off unless set
    s3_gateway_region: str = "us-east-1"  # the region SigV4 scopes must name
    s3_gateway_domain: str | None = None  # virtual-host-style addressing: BUCKET.<domain>

    @property
    def worker_count(self) -> int:
        """``workers`` as a number. "auto" must have been resolved first
        (server.py does, before anything counts processes)."""
        if isinstance(self.workers, str):
            raise RuntimeError('workers="auto" was not resolved (kvstore.workers.auto_workers)')
        return self.workers

    @property
    def s3_gateway_address(self) -> tuple[str, int] | None:
        if not self.s3_gateway_listen:
            return None
        host, _, port = self.s3_gateway_listen.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def tcp_addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every TCP address to listen on."""
        out = []
        for a in self.listen.split(","):
            if not a.startswith(UNIX):
                host, _, port = a.rpartition(":")
                out.append((host.strip("[]"), int(port)))
        return out

    @property
    def unix_paths(self) -> list[str]:
        """Every unix socket to listen on."""
        return [a[len(UNIX) :] for a in self.listen.split(",") if a.startswith(UNIX)]

    def admin_secret(self) -> str | None:
        """The admin token, from ``admin_token`` or the file ``admin_token_file``."""
        return _secret("admin_token_file", self.admin_token, self.admin_token_file)

    def metrics_secret(self) -> str | None:
        """The token ``/metrics`` requires, from ``metrics_token`` or ``metrics_token_file``."""
        return _secret("metrics_token_file", self.metrics_token, self.metrics_token_file)


def check_data_dir(path: Path) -> None:
    """``data_dir`` is a directory, or can be made one: neither it nor the
    nearest of its parents that exists is something else (a file)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "it" if existing == path else f"{str(existing)!r}"
        raise ConfigError(f"data_dir={str(path)!r}: {what} is not a directory")


def _secret(file_setting: str, value: str | None, path: str | None) -> str | None:
    """A secret given itself (from the environment) or as a file holding it."""
    if value:
        return value
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise ConfigError(f"{file_setting}={path!r}: {e.strerror}") from None
        if not token:
            raise ConfigError(f"{file_setting}={path!r}: the file is empty")
        return token
    return None


# Tokens shorter than this are refused at start-up: a token is the whole of
# what guards the admin API (and /metrics, where set). 32 characters of
# secrets.token_urlsafe carry 192 bits.
MIN_TOKEN_CHARS: Final = 32
# What the shipped examples' placeholders hold (deploy/kvstore.env.example's
# "replace-with-a-long-random-token"): refused whatever the token's length.
PLACEHOLDER: Final = "replace-with"


def check_tokens(cfg: ServerConfig) -> None:
    """Refuse, at start-up, an admin or metrics token that is an example or
    shorter than :data:`MIN_TOKEN_CHARS` (naming the setting, never the token)."""
    for setting, token in (("admin_token", cfg.admin_secret()), ("metrics_token", cfg.metrics_secret())):
        if token is None:
            continue
        where = f"{setting} (KVSTORE_{setting.upper()} or {setting}_file)"
        if PLACEHOLDER in token:
            raise ConfigError(f"{where} is the example's placeholder: set a random one, e.g. {_MAKE_TOKEN}")
        if len(token) < MIN_TOKEN_CHARS:
            have = f"{len(token)} characters, fewer than {MIN_TOKEN_CHARS}"
            raise ConfigError(f"{where} has {have}: set a random one, e.g. {_MAKE_TOKEN}")


_MAKE_TOKEN = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


_SERVER_PARSERS: dict[str, Callable[[str, object], Any]] = {
    "listen": _listen,
    "workers": _workers,
    "admin_token": _str,
    "admin_token_file": _str,
    "metrics_token": _str,
    "metrics_token_file": _str,
    "metrics_tenant_labels": parse_bool,
    "master_key_file": _str,
    "master_key": _str,
    "tls_cert": _str,
    "tls_key": _str,
    "max_lookup_keys": _positive,
    "max_batch_keys": _positive,
    "max_concurrency": _positive,
    "max_buffered_body_bytes": parse_size,
    "request_timeout_s": _positive,
    "keepalive_timeout_s": _positive,
    "shutdown_timeout_s": _positive,
    "log_level": _log_level,
    "log_format": lambda name, value: parse_choice(name, value, LOG_FORMATS),
    "unix_socket_mode": _mode,
    "unix_socket_group": _str,
    "sendfile": parse_bool,
    "fast_lane": parse_bool,
    "qos_max_wait_ms": _wait_ms,
    "qos_transfers_per_worker": _positive,
    "plan_paths": parse_bool,
    "nixl": parse_bool,
    "nixl_backend": _str,
    "nixl_staging_bytes": parse_size,
    "nixl_lease_s": _positive,
    "nixl_devices": _str,
    "events_zmq": _zmq_endpoint,
    "events_zmq_replay": _zmq_endpoint,
    "events_encoding": lambda name, value: parse_choice(name, value, ("map", "array")),
    "events_backlog": _positive,
    "events_queue": _positive,
    "events_medium_local": _str,
    "events_medium_object": _str,
    "s3_gateway_listen": _tcp_address,
    "s3_gateway_region": _region,
    "s3_gateway_domain": _domain,
}
_STORE_FIELDS = set(STORE_PARSERS)
SETTINGS: tuple[str, ...] = ("data_dir", *_SERVER_PARSERS, *sorted(_STORE_FIELDS))
# KVSTORE_* variables that are not settings, read by other programs that may
# share the daemon's environment (an operator's shell, the bench harness,
# which passes its KVSTORE_* variables on): allowed, and ignored here.
OTHER_VARIABLES = frozenset(
    {
        "KVSTORE_CONFIG",  # the TOML file (read by load)
        "KVSTORE_TOKEN",  # the client library's tenant token (clients/kvstore_client, bench)
        "KVSTORE_URL",  # the daemon's URL for kvstore admin (kvstore/admin/), set in an operator's shell
        "KVSTORE_TOKEN_FILE",
        "KVSTORE_FUZZ_SECONDS",  # the test suites (tests/fuzz, tests/stress, tests/fault, tests/s3)
        "KVSTORE_FUZZ_SEED",
        "KVSTORE_STRESS_SECONDS",
        "KVSTORE_STRESS_SEED",
        "KVSTORE_CRASH_SEED",
        "KVSTORE_CRASH_ITERATIONS",
        "KVSTORE_CRASH_REBUILD_ITERATIONS",
        "KVSTORE_TEST_MASTER_KEY",
        "KVSTORE_TEST_AWS_CLI",
        "KVSTORE_TEST_FAULT_LOG",
        "KVSTORE_TEST_DEAD_ENDPOINT",
        "KVSTORE_TEST_CRASH_AT",
        "KVSTORE_TEST_STOPS",  # tests/http/test_stops.py: stops per case
        "KVSTORE_ENGINE",  # deploy/container/build.sh: podman or buildah
        "KVSTORE_DEBIAN_MIRROR",  # and the Debian mirror and pull timeout of its base image
        "KVSTORE_PULL_TIMEOUT_S",
    }
)


# The variables Kubernetes gives every pod for each Service in its namespace
# (service links): for a Service named "kvstore", KVSTORE_SERVICE_HOST,
# KVSTORE_SERVICE_PORT[_NAME], KVSTORE_PORT=tcp://IP:PORT and
# KVSTORE_PORT_8420_TCP[_PROTO|_PORT|_ADDR]; for "kvstore-fleet", the same
# under KVSTORE_FLEET_. They are not settings (no setting ends so) and a pod
# cannot refuse them all (enableServiceLinks: false stops only some), so they
# are ignored, never refused.
_SERVICE_LINK = re.compile(
    r"KVSTORE(_[A-Z0-9_]+?)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT|PORT_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)"
)


def is_service_link(var: str) -> bool:
    """Whether ``var`` is one of Kubernetes' service-link variables."""
    return _SERVICE_LINK.fullmatch(var) is not None and var.removeprefix(ENV_PREFIX).lower() not in SETTINGS


def check_env(env: Mapping[str, str]) -> None:
    """Refuse a ``KVSTORE_*`` variable that names no setting (a misspelling
    would otherwise be ignored silently), with the closest setting's name;
    Kubernetes' service-link variables are not refused."""
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in OTHER_VARIABLES or is_service_link(var):
            continue
        if var.removeprefix(ENV_PREFIX).lower() not in SETTINGS or not var.isupper():
            raise ConfigError(f"environment variable {var!r} is not a setting{_hint(var)}")


def _hint(var: str) -> str:
    """ "; did you mean X?" for the setting (or other variable) closest to
    ``var``, compared without the common prefix."""
    names = {name: ENV_PREFIX + name.upper() for name in SETTINGS}
    names |= {other.removeprefix(ENV_PREFIX).lower(): other for other in OTHER_VARIABLES}
    close = difflib.get_close_matches(var.removeprefix(ENV_PREFIX).lower(), list(names), n=1, cutoff=0.75)
    if close:
        return f"; did you mean {names[close[0]]}?"
    return "; every setting is listed in deploy/kvstore.toml (KVSTORE_<SETTING IN CAPITALS>)"


# Secrets may come from the environment or a file, never from a config file
# that is likely to be world-readable or committed.
SECRETS: Final = frozenset({"admin_token", "master_key", "metrics_token"})


def is_size(name: str) -> bool:
    """Whether setting ``name`` is a size in bytes (taken as "256MiB" too)."""
    return _SERVER_PARSERS.get(name, STORE_PARSERS.get(name)) is parse_size


def setting_value(cfg: ServerConfig, name: str) -> Any:
    """The value of setting ``name`` in ``cfg`` (a storage setting's from ``cfg.store``)."""
    if name == "data_dir":
        return str(cfg.store.data_dir)
    if name in _STORE_FIELDS:
        return getattr(cfg.store, name)
    return getattr(cfg, name)


def _parse(label: str, name: str, value: object) -> Any:
    if name == "data_dir":
        return _str(label, value)
    if name in _SERVER_PARSERS:
        return _SERVER_PARSERS[name](label, value)
    return parse_field(label, name, value)


SourceKind = Literal["default", "file", "environment", "flag"]


@dataclass(frozen=True, slots=True)
class Source:
    """Where a setting's value came from: ``kind``, and the file, variable or
    flag (``where``; None for a default)."""

    kind: SourceKind
    where: str | None = None

    def __str__(self) -> str:
        return self.kind if self.where is None else f"{self.kind} {self.where}"


DEFAULT: Final = Source("default")


def load(
    toml_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> ServerConfig:
    """Build the configuration from its three sources, each overriding the last."""
    return load_with_sources(toml_path, env, flags)[0]


def load_with_sources(
    toml_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> tuple[ServerConfig, dict[str, Source]]:
    """:func:`load`, and where each setting of :data:`SETTINGS` came from
    (:data:`DEFAULT` for those no source sets)."""
    env = os.environ if env is None else env
    check_env(env)
    values: dict[str, Any] = {}
    sources = dict.fromkeys(SETTINGS, DEFAULT)
    path = toml_path or env.get("KVSTORE_CONFIG")
    if path:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
        for key, value in doc.items():
            if key not in SETTINGS:
                close = difflib.get_close_matches(key, SETTINGS, n=1, cutoff=0.75)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"config file {str(path)!r}: unknown key {key!r}{hint}")
            if key in SECRETS:
                raise ConfigError(f"config file {str(path)!r}: {key!r} is a secret; use {key}_file or the environment")
            values[key] = _parse(key, key, value)
            sources[key] = Source("file", str(path))
    from_env = env_values(env, SETTINGS, _parse)
    values |= from_env
    sources |= {name: Source("environment", ENV_PREFIX + name.upper()) for name in from_env}
    for name, value in (flags or {}).items():
        if value is None:
            continue
        if name not in SETTINGS:
            raise ConfigError(f"unknown setting {name!r}")
        flag = "--" + name.replace("_", "-")
        values[name] = _parse(flag, name, value)
        sources[name] = Source("flag", flag)
    data_dir = values.pop("data_dir", "data")
    store_values = {k: values.pop(k) for k in list(values) if k in _STORE_FIELDS}
    store = StoreConfig(data_dir=Path(data_dir), **store_values)
    cfg = ServerConfig(store=store, **values)
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("tls_cert and tls_key must be set together")
    if cfg.events_zmq_replay and not cfg.events_zmq:
        raise ConfigError("events_zmq_replay needs events_zmq (the replay serves what the PUB socket published)")
    if cfg.events_zmq_replay and cfg.events_zmq_replay == cfg.events_zmq:
        raise ConfigError("events_zmq and events_zmq_replay must be two endpoints")
    if cfg.s3_gateway_listen and cfg.s3_gateway_listen in cfg.listen.split(","):
        raise ConfigError(
            f"s3_gateway_listen={cfg.s3_gateway_listen!r} is also in listen: the gateway needs its own address"
        )
    if cfg.max_buffered_body_bytes < store.max_block_size:
        raise ConfigError(
            f"max_buffered_body_bytes={cfg.max_buffered_body_bytes} is below max_block_size={store.max_block_size}:"
            " a block of the maximum size could never be accepted"
        )
    return cfg, sources

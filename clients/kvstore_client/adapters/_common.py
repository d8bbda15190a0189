"""What the engine adapters share: settings parsing and an event loop thread.

No engine is imported here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import threading
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from kvstore_client.adapters.planner import LoadPlanner
from kvstore_client.client import AsyncClient

T = TypeVar("T")

# Settings every adapter accepts (the engine-specific ones are added by each adapter).
CLIENT_SETTINGS = (
    "endpoints",
    "token",
    "token_file",
    "timeout",
    "retries",
    "replicas",
    "ca_file",
    "transport",  # "http" (default) or "nixl": get_into/put_many over NIXL, falling back to HTTP
    "nixl_devices",  # UCX_NET_DEVICES for the client's NIXL agent (unset: UCX's choice)
    "fleet",  # true: endpoints are seeds of a fleet; its members come from GET /v1/fleet
)


# Load planning (kvstore_client/adapters/planner.py): the engine's prefill throughput, and the margin.
PLAN_SETTINGS = ("prefill_tokens_per_s", "load_margin")


def load_planner(s: Settings) -> LoadPlanner | None:
    """The adapter's load planner: with ``prefill_tokens_per_s`` set, and
    ``load_margin`` (1.1; at least 1: never plan a slower load); else None."""
    margin = max(1.0, s.get_float("load_margin", 1.1, minimum=0.999))
    return (
        LoadPlanner(s.get_float("prefill_tokens_per_s", 1.0), margin=margin) if s.has("prefill_tokens_per_s") else None
    )


def escape(text: str, unsafe: re.Pattern[str]) -> str:
    """``text`` with each run of characters ``unsafe`` matches written
    ``~XX`` per UTF-8 byte (upper-case hex): the adapters' reversible way
    into the kvstore key grammar."""
    return unsafe.sub(lambda m: "".join(f"~{b:02X}" for b in m.group().encode("utf-8")), text)


def unescape(text: str) -> str:
    """The inverse of :func:`escape`."""
    raw = bytearray()
    i = 0
    while i < len(text):
        if text[i] == "~":
            raw.append(int(text[i + 1 : i + 3], 16))
            i += 3
        else:
            raw += text[i].encode("ascii")
            i += 1
    return raw.decode("utf-8")


class Settings:
    """A view of an adapter's settings (an engine's "extra config") that refuses
    unknown names and bad values, naming the setting and the value: a typo must
    not silently fall back to a default."""

    def __init__(self, raw: Mapping[str, Any], where: str, known: Iterable[str], prefix: str = "") -> None:
        self.where = where
        self.prefix = prefix
        self._raw = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix)}
        unknown = sorted(set(self._raw) - set(known))
        if unknown:
            names = ", ".join(prefix + u for u in unknown)
            allowed = ", ".join(prefix + k for k in sorted(known))
            raise ValueError(f"{where}: unknown setting(s) {names}; known: {allowed}")

    def _bad(self, name: str, value: object, expected: str) -> ValueError:
        return ValueError(f"{self.where}: setting {self.prefix}{name}={value!r} is invalid: expected {expected}")

    def has(self, name: str) -> bool:
        return self._raw.get(name) is not None

    def get_str(self, name: str, default: str | None = None) -> str | None:
        v = self._raw.get(name, default)
        if v is None:
            return None
        if not isinstance(v, str) or not v:
            raise self._bad(name, v, "a non-empty string")
        return v

    def get_float(self, name: str, default: float, *, minimum: float = 0.0) -> float:
        v = self._raw.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int | float | str):
            raise self._bad(name, v, "a number")
        try:
            f = float(v)
        except ValueError:
            raise self._bad(name, v, "a number") from None
        if not f > minimum:
            raise self._bad(name, v, f"a number > {minimum}")
        return f

    def get_int(self, name: str, default: int, *, minimum: int = 0) -> int:
        v = self._raw.get(name, default)
        if isinstance(v, bool):
            raise self._bad(name, v, "an integer")
        try:
            i = int(v)
        except (TypeError, ValueError):
            raise self._bad(name, v, "an integer") from None
        if i < minimum or (isinstance(v, float) and v != i):
            raise self._bad(name, v, f"an integer >= {minimum}")
        return i

    def get_bool(self, name: str, default: bool) -> bool:
        v = self._raw.get(name, default)
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.lower() in ("true", "1", "yes", "false", "0", "no"):
            return v.lower() in ("true", "1", "yes")
        raise self._bad(name, v, "true or false")

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        v = self._raw.get(name, default)
        if v not in choices:
            raise self._bad(name, v, " or ".join(choices))
        return str(v)

    def endpoints(self) -> list[str]:
        """``endpoints``: a list of URLs, or one string with comma-separated URLs."""
        v = self._raw.get("endpoints")
        if isinstance(v, str):
            eps = [e.strip() for e in v.split(",") if e.strip()]
        elif isinstance(v, list | tuple) and all(isinstance(e, str) for e in v):
            eps = [e.strip() for e in v if e.strip()]
        else:
            eps = []
        if not eps:
            raise self._bad("endpoints", v, "kvstore URLs, e.g. 'http://127.0.0.1:8420' (a list or comma-separated)")
        return eps

    def client(self, *, timeout: float | None = None, **overrides: Any) -> AsyncClient:
        """An AsyncClient from the common settings; ``timeout`` overrides ``timeout``."""
        kwargs: dict[str, Any] = {
            "token": self.get_str("token"),
            "token_file": self.get_str("token_file"),
            "timeout": timeout if timeout is not None else self.get_float("timeout", 2.0),
            "retries": self.get_int("retries", 1),
            "replicas": self.get_int("replicas", 1, minimum=1),
            "ca_file": self.get_str("ca_file"),
            "transport": self.choice("transport", "http", ("http", "nixl")),
            "nixl_devices": self.get_str("nixl_devices"),
            "fleet": self.get_bool("fleet", False),
        }
        kwargs.update(overrides)
        return AsyncClient(self.endpoints(), **kwargs)


class LoopThread:
    """An asyncio event loop on a daemon thread, for engines that call from
    their own threads: :meth:`submit` schedules a coroutine and returns a
    concurrent future; :meth:`run` waits for it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise RuntimeError("the loop thread is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (at most ``timeout`` seconds:
        then the coroutine is cancelled and TimeoutError raised)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result within {timeout} s") from None

    def close(self, clients: Iterable[AsyncClient] = ()) -> None:
        """Close ``clients`` on the loop, then stop the loop and join the thread."""
        if self._closed:
            return
        for c in clients:
            with contextlib.suppress(TimeoutError, RuntimeError):
                self.run(c.close(), timeout=5)
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

"""A synchronous facade: an :class:`AsyncClient` on a private event loop in a
background thread, for engines that call synchronously. Same methods, same
fail-open contract; safe to call from several threads at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

from kvstore_client.client import AsyncClient
from kvstore_client.errors import KVStoreClientError
from kvstore_client.wire.batchframe import BufferLike

T = TypeVar("T")


class Client:
    """``Client(endpoints, token, ...)`` takes the arguments of :class:`AsyncClient`."""

    def __init__(self, endpoints: list[str] | str, token: str | Mapping[str, str] | None = None, **kwargs: Any) -> None:
        self._async = AsyncClient(endpoints, token, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def stats(self) -> dict[str, int]:
        return self._async.stats

    @property
    def aclient(self) -> AsyncClient:
        """The underlying AsyncClient (its coroutines must run on this client's loop)."""
        return self._async

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise KVStoreClientError("the client is closed", code="closed")
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    def put(self, key: str, data: BufferLike) -> bool:
        return self._run(self._async.put(key, data))

    def put_many(self, items: Iterable[tuple[str, BufferLike]]) -> list[bool]:
        return self._run(self._async.put_many(list(items)))

    def get(self, key: str) -> bytes | None:
        return self._run(self._async.get(key))

    def get_into(self, key: str, buf: Any) -> int | None:
        return self._run(self._async.get_into(key, buf))

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        return self._run(self._async.get_range(key, start, end))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._run(self._async.get_many(keys))

    def get_prefix(self, keys: Sequence[str], bufs: Sequence[Any], deadline_s: float) -> int:
        """As :meth:`AsyncClient.get_prefix`: the leading keys complete in ``bufs`` by the deadline."""
        return self._run(self._async.get_prefix(keys, bufs, deadline_s))

    def wait_loads(self) -> None:
        """As :meth:`AsyncClient.wait_loads`."""
        self._run(self._async.wait_loads())

    def bandwidth(self, endpoint: str | None = None, transport: str | None = None) -> float | None:
        return self._async.bandwidth(endpoint, transport)

    def exists(self, key: str) -> bool:
        return self._run(self._async.exists(key))

    def lookup(self, keys: Sequence[str]) -> int:
        return self._run(self._async.lookup(keys))

    def lookup_detail(self, keys: Sequence[str]) -> list[bool]:
        return self._run(self._async.lookup_detail(keys))

    def delete(self, key: str) -> bool:
        return self._run(self._async.delete(key))

    def close(self) -> None:
        if self._closed:
            return
        self._run(self._async.close())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

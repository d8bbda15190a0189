"""Where records may be decoded here, and the threads that decode them.

With ``decode="client"`` (or ``"auto"``, where allowed) reads fetch records
as stored and check and decode their frames in this process: the daemon
then hands out each record's own key, so it does so only on a unix socket,
over TLS or on loopback (it checks the same itself).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Literal
from urllib.parse import urlsplit

from kvstore_client.sharding import UNIX

Decode = Literal["server", "client", "auto"]
_LOOPBACK_HOSTS = frozenset({"localhost", "::1", "ip6-localhost"})


def decode_allowed(url: str) -> bool:
    """Whether a daemon hands records with their keys out on ``url``: a
    unix socket, TLS, or a loopback address (it checks the same itself)."""
    if url.startswith(UNIX):
        return True
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    return parts.scheme == "https" or host in _LOOPBACK_HOSTS or host.startswith("127.")


def decode_available() -> bool:
    """Whether this process can open records itself (``pip install
    'kvstore-client[decode]'``: cryptography, zstandard, numpy)."""
    try:
        import kvstore_client.record  # noqa: F401
    except ImportError:
        return False
    return True


class DecodePool:
    """The threads that open and decode records' frames here, made on first use."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def get(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvstore-decode")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

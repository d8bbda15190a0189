"""Client library of the kvstore KV-cache block daemon (HTTP v1)."""

from kvstore_client.breaker import CircuitBreaker
from kvstore_client.client import AsyncClient
from kvstore_client.errors import (
    BufferTooSmall,
    CircuitOpenError,
    CorruptBlock,
    DeadlineExceeded,
    InvalidKeyError,
    KVStoreClientError,
    ProtocolError,
    ServerError,
    UnavailableError,
)
from kvstore_client.keys import block_keys, model_fingerprint
from kvstore_client.lookups import Locks
from kvstore_client.sharding import rank_endpoints
from kvstore_client.sync import Client

__all__ = [
    "AsyncClient",
    "Locks",
    "BufferTooSmall",
    "CircuitBreaker",
    "CircuitOpenError",
    "Client",
    "CorruptBlock",
    "DeadlineExceeded",
    "InvalidKeyError",
    "KVStoreClientError",
    "ProtocolError",
    "ServerError",
    "UnavailableError",
    "block_keys",
    "model_fingerprint",
    "rank_endpoints",
]
# Written by each build from git (clients/build_version.py); a tree never built says so.
try:
    from kvstore_client._version import __version__ as __version__
except ImportError:  # pragma: no cover - a tree never built
    __version__ = "0+unknown"

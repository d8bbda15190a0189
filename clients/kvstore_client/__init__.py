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
__version__ = "0.1.0"

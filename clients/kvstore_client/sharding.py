"""Which endpoints own a key: rendezvous (highest random weight) hashing.

A server going away moves only the keys it owned; its share is spread over
the others. The weight is blake2b, so the order is the same in every process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

UNIX = "unix:"  # unix:PATH, a daemon's unix socket on this host


def normalize(endpoint: str) -> str:
    """``host:port`` or a URL, as a URL without a trailing slash; ``unix:PATH``
    as it is."""
    endpoint = endpoint.strip()
    if endpoint.startswith(UNIX):
        if len(endpoint) == len(UNIX):
            raise ValueError(f"endpoint {endpoint!r}: 'unix:' needs the socket's path")
        return endpoint
    endpoint = endpoint.rstrip("/")
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    return endpoint


def rank_endpoints(endpoints: Sequence[str], key: str) -> list[str]:
    """``endpoints`` ordered by rendezvous weight for ``key``: blake2b-64 of
    ``endpoint + "\\n" + key``, highest first (stable across processes)."""

    def weight(ep: str) -> int:
        digest = hashlib.blake2b(f"{ep}\n{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(endpoints, key=weight, reverse=True)

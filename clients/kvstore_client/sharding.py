"""Which endpoints own a key: rendezvous (highest random weight) hashing.

A server going away moves only the keys it owned; its share is spread over
the others. The weight is blake2b, so the order is the same in every process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

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


class Shards:
    """Where each key lives: its top ``replicas`` endpoints by rendezvous
    weight; writes go to all of them, reads try them in rank order."""

    def __init__(self, urls: Sequence[str], replicas: int) -> None:
        self.urls = list(urls)
        self.replicas = replicas

    def owners(self, key: str) -> list[str]:
        """The endpoints that hold ``key``, in the order reads try them."""
        if len(self.urls) == 1:
            return list(self.urls)
        return rank_endpoints(self.urls, key)[: self.replicas]

    def by_first_owner(self, keys: Sequence[str], idx: Iterable[int]) -> dict[str, list[int]]:
        """The indices ``idx`` of ``keys`` grouped by their first owner."""
        groups: dict[str, list[int]] = {}
        for i in idx:
            groups.setdefault(self.owners(keys[i])[0], []).append(i)
        return groups


def group(idx: Iterable[int], owners: Sequence[Sequence[str]], rank: int) -> dict[str, list[int]]:
    """The indices ``idx`` grouped by their owner of ``rank`` (those with
    fewer owners left out), in the order of ``idx``."""
    groups: dict[str, list[int]] = {}
    for i in idx:
        if rank < len(owners[i]):
            groups.setdefault(owners[i][rank], []).append(i)
    return groups

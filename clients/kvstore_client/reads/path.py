"""The read path of ``get_into`` and ``get_many_into``: its readers, in the one order they are tried.

1. NIXL (``transport="nixl"``): one control call and one transfer per owner
   (kvstore_client/reads/nixl.py);
2. a read plan over the daemon's unix socket (``unix:`` endpoints,
   ``read_plans``): the segment files' descriptors, read here
   (kvstore_client/reads/unix_plan.py);
3. a read plan with paths (http(s) endpoints, ``plan_paths``): the segment
   files on a shared filesystem (kvstore_client/reads/path_plan.py);
4. HTTP, which serves every key left: the record as stored, decoded here
   where the endpoint decodes here (``decode``), else GET
   (kvstore_client/reads/http.py). The two are chosen per endpoint inside
   one exchange, because the daemon's answer decides (a refusal, a direct
   tenant) and the retries, owners and deadline are the same.

Each reader serves what it can and leaves the rest to the next; a key's
read ends with its size, None (absent), or an error (a buffer too small, a
corrupt block). Plans and NIXL ask the key's first owner; HTTP tries them all.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore_client.reads.base import Outcome, Reader
from kvstore_client.reads.http import HttpReader
from kvstore_client.reads.nixl import NixlReader
from kvstore_client.reads.path_plan import PathPlanReader
from kvstore_client.reads.unix_plan import UnixPlanReader


class ReadPath:
    def __init__(
        self, nixl: NixlReader | None, unix_plans: UnixPlanReader, path_plans: PathPlanReader, http: HttpReader
    ) -> None:
        named = (("nixl", nixl), ("unix", unix_plans), ("paths", path_plans), ("http", http))
        self.readers: list[tuple[str, Reader]] = [(name, r) for name, r in named if r is not None]

    async def read(
        self, keys: Sequence[str], bufs: Sequence[memoryview], via: list[str] | None = None
    ) -> list[Outcome]:
        """Each of ``keys`` into the buffer at the same place in ``bufs``: its
        outcome; ``via`` (as long as ``keys``), where given, gets the name of
        the transport that served each (nixl, unix, paths, http)."""
        out: list[Outcome] = [None] * len(keys)
        todo = list(range(len(keys)))
        for name, reader in self.readers:
            if not todo:
                break
            served, todo = await reader.read(keys, bufs, todo)
            for i, outcome in served.items():
                out[i] = outcome
                if via is not None:
                    via[i] = name
        return out

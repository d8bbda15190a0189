"""Fault injection for the vLLM connector tests (loaded by vLLM through
``kv_connector_module_path``, like any third-party connector).

``DaemonGoneBeforeLoad``: the scheduler's lookup reaches the real daemon, but
the worker's loads go to an endpoint where nothing listens, as if the daemon
died between the lookup and the load. The worker must report every planned
block as a load error and vLLM recompute them.

``LaterGroupsCut``: a layerwise load whose first layer group arrives whole
and whose later groups stop after their first block, as a load cut by its
deadline does: every block past the first is a load error the engine
recomputes, although the forward pass started on the first group's layers.

Both write the load errors they report to ``KVSTORE_TEST_FAULT_LOG``, the
test's evidence that the failure path was taken (the engine process's only
other output is the generated tokens).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvstore_client.adapters.vllm import BlockTransfer, KVStoreConnector
from kvstore_client.client import AsyncClient


class _ReportsLoadErrors(KVStoreConnector):
    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if errors:
            with open(os.environ["KVSTORE_TEST_FAULT_LOG"], "a") as f:
                f.write(f"{len(errors)}\n")
        return errors


class DaemonGoneBeforeLoad(_ReportsLoadErrors):
    def _init_worker(self) -> None:
        super()._init_worker()
        dead = os.environ["KVSTORE_TEST_DEAD_ENDPOINT"]
        self._load_client = AsyncClient(dead, "no-token", timeout=self.load_timeout, retries=0)
        self._clients.append(self._load_client)


class LaterGroupsCut(_ReportsLoadErrors):
    def _init_worker(self) -> None:
        super()._init_worker()
        real = self._load_client.get_prefix
        self._first_group: set[str] = set()

        async def cut(keys: Sequence[str], bufs: Sequence[Any], deadline_s: float) -> int:
            if keys and keys[0] not in self._first_group:  # a later group: it stops after one block
                keys, bufs = keys[:1], bufs[:1]
            return await real(keys, bufs, deadline_s)

        self._load_client.get_prefix = cut  # type: ignore[method-assign]

    def _start_layerwise(self, load: BlockTransfer) -> None:
        self._first_group.update(load.keys.get(self._glabel(0), []))
        super()._start_layerwise(load)

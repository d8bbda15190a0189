"""Fault injection for the vLLM connector tests (loaded by vLLM through
``kv_connector_module_path``, like any third-party connector).

``DaemonGoneBeforeLoad``: the scheduler's lookup reaches the real daemon, but
the worker's loads go to an endpoint where nothing listens, as if the daemon
died between the lookup and the load. The worker must report every planned
block as a load error and vLLM recompute them.
"""

from __future__ import annotations

import os

from kvstore_client.adapters.vllm import KVStoreConnector
from kvstore_client.client import AsyncClient


class DaemonGoneBeforeLoad(KVStoreConnector):
    def _init_worker(self) -> None:
        super()._init_worker()
        dead = os.environ["KVSTORE_TEST_DEAD_ENDPOINT"]
        self._load_client = AsyncClient(dead, "no-token", timeout=self.load_timeout, retries=0)
        self._clients.append(self._load_client)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if errors:
            # Evidence for the test that the failure path was taken (the engine
            # process's only other output is the generated tokens).
            with open(os.environ["KVSTORE_TEST_FAULT_LOG"], "a") as f:
                f.write(f"{len(errors)}\n")
        return errors

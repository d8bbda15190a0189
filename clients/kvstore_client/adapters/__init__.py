"""Engine adapters: kvstore as the external KV-cache store of inference engines.

One module per engine, each loadable the way that engine loads third-party
storage (see ``docs/engines.md`` for the exact command lines):

* :mod:`kvstore_client.adapters.vllm`: a vLLM v1 KV connector
  (``KVConnectorBase_V1``), ``kv_connector_module_path=kvstore_client.adapters.vllm``;
* :mod:`kvstore_client.adapters.lmcache`: an LMCache remote storage plugin
  (a ``ConnectorAdapter`` and its ``RemoteConnector``);
* :mod:`kvstore_client.adapters.sglang`: an SGLang HiCache storage backend
  (``--hicache-storage-backend dynamic``).

This package imports no engine: each module imports its engine (and torch)
itself, so ``import kvstore_client`` stays light. Every adapter is fail-open:
a kvstore that is down, slow or erroring makes the engine recompute, never
crash or wait past the configured timeouts.
"""

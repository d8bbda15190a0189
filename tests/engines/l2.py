"""Driving an LMCache multiprocess-mode L2 adapter as LMCache's controllers do:
built from its ``--l2-adapter`` JSON through LMCache's own argument parser,
config registry and adapter factory (what ``StorageManager`` calls), then
tasks submitted and their completions awaited on the adapter's event fds.
Memory objects are the type LMCache's L1 hands its adapters."""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import time
import warnings
from typing import Any

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

TASK_TIMEOUT_S = 30.0


def parser_quiet(build: Any) -> Any:
    """``build()`` with the warnings LMCache's parser raises silenced: its help
    lists every adapter type, which imports every adapter module (google-api-core's
    Python-version notices from the Bigtable one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return build()


def make_adapter(spec: dict[str, Any], class_name: str) -> Any:
    """The adapter as the MP server makes it: ``--l2-adapter JSON`` through
    LMCache's parser and config registry, then the factory (``create_l2_adapter``,
    what ``StorageManager._build_l2_adapter`` calls)."""
    parser = parser_quiet(lambda: add_l2_adapters_args(argparse.ArgumentParser()))
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    assert len(config.adapters) == 1
    adapter = parser_quiet(lambda: create_l2_adapter(config.adapters[0]))
    assert type(adapter).__name__ == class_name, type(adapter)
    return adapter


def chunk(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A KV chunk in host memory, the memory object type LMCache's L1 hands its L2 adapters."""
    g = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, generator=g).to(dtype)
    meta = MemoryObjMetadata(
        shape=torch.Size(shape),
        dtype=dtype,
        address=0,
        phy_size=tensor.numel() * tensor.element_size(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(tensor, meta, parent_allocator=None)


def empty_like(obj: Any) -> Any:
    out = chunk(tuple(obj.tensor.shape), 0, obj.tensor.dtype)
    out.tensor.zero_()
    return out


def raw(obj: Any) -> bytes:
    return bytes(obj.byte_array)


def key(n: int, *, model: str, rank: int = 0, group: int = 0, salt: str = "") -> Any:
    return ObjectKey(
        chunk_hash=n.to_bytes(32, "big"), model_name=model, kv_rank=rank, object_group_id=group, cache_salt=salt
    )


def _wait(fd: int) -> None:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    assert poll.poll(int(TASK_TIMEOUT_S * 1000)), f"no completion within {TASK_TIMEOUT_S} s"
    with contextlib.suppress(BlockingIOError):  # another wait consumed it
        consume_fd(fd)


def _until(get: Any) -> Any:
    """Poll ``get()`` until it answers (the adapter signals each task's fd, possibly
    once for several tasks)."""
    deadline = time.monotonic() + TASK_TIMEOUT_S
    while (got := get()) is None:
        assert time.monotonic() < deadline, f"no result within {TASK_TIMEOUT_S} s"
        time.sleep(0.01)
    return got


def store(adapter: Any, keys: list[Any], objs: list[Any]) -> Any:
    """A store task's ``L2StoreResult``."""
    task = adapter.submit_store_task(keys, objs)
    _wait(adapter.get_store_event_fd())
    return _until(lambda: adapter.pop_completed_store_tasks().get(task))


def lookup(adapter: Any, keys: list[Any], objs: list[Any] | None = None) -> list[bool]:
    """A lookup-and-lock task's bitmap, as a list (asserting it is returned once)."""
    layouts = {}
    if objs:
        layouts = {0: MemoryLayoutDesc(shapes=[objs[0].tensor.shape], dtypes=[objs[0].tensor.dtype])}
    task = adapter.submit_lookup_and_lock_task(keys, layouts)
    _wait(adapter.get_lookup_and_lock_event_fd())
    bitmap = _until(lambda: adapter.query_lookup_and_lock_result(task))
    assert adapter.query_lookup_and_lock_result(task) is None, "a lookup's result is returned once"
    return [bool(bitmap.test(i)) for i in range(len(keys))]


def load(adapter: Any, keys: list[Any], objs: list[Any]) -> list[bool]:
    """A load task's bitmap, as a list (asserting it is returned once)."""
    task = adapter.submit_load_task(keys, objs)
    _wait(adapter.get_load_event_fd())
    bitmap = _until(lambda: adapter.query_load_result(task))
    assert adapter.query_load_result(task) is None, "a load's result is returned once"
    return [bool(bitmap.test(i)) for i in range(len(keys))]

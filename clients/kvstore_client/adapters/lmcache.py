"""kvstore as an LMCache remote storage plugin (LMCache 0.5.x).

LMCache configuration (YAML, or the same keys as ``LMCACHE_*`` variables)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_serde: naive
    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore_client.adapters.lmcache
      remote_storage_plugin.kvstore.class_name: KVStoreConnectorAdapter
      remote_storage_plugin.kvstore.endpoints: http://127.0.0.1:8420
      remote_storage_plugin.kvstore.token_file: /etc/kvstore/tenant.token

The plugin name must be ``kvstore`` or ``kvstore.<instance>`` (LMCache hands
an adapter only the URL ``plugin://<name>``; this one claims the ``kvstore``
type). :class:`KVStoreConnectorAdapter` is a ``ConnectorAdapter``, so LMCache
gives it the engine metadata (a plain ``RemoteConnector`` class would be
built without it). Settings, under ``remote_storage_plugin.<name>.``:
``endpoints`` (required), ``token`` / ``token_file`` (else ``$KVSTORE_TOKEN``),
``timeout`` (s, per call, default 2), ``retries``, ``replicas``, ``ca_file``.

Keys: LMCache's ``CacheEngineKey.to_string()`` (model, world size, worker,
chunk hash, dtype, tags) mapped reversibly onto the kvstore key grammar:
``lmc.`` + the string with every character outside ``[A-Za-z0-9._:@=+-]``
written ``~XX`` (its UTF-8 bytes in hex); a mapped key over 256 characters is
``lmc~`` + the BLAKE2b-128 of the string instead.

Values: a header, then the MemoryObj's bytes (``byte_array``), so that a get
can allocate the right shapes, dtypes and format (partial chunks included)::

    offset  size  field
    0       4     magic b"KVLC"
    4       1     version (1)
    5       1     LMCache MemoryFormat value
    6       1     number of tensors n (1..255)
    7       1     flags (0; any other value is rejected)
    8       8     payload length, u64 little-endian
    16      ...   n times: u8 len + dtype name (torch, e.g. "bfloat16"), u8 ndim, ndim x u32 dims
    ...           payload

Fail-open: a failed call is a miss (``exists`` False, ``get`` None, a
contains count 0, puts dropped and counted by the client library); a block
whose header or size does not check is a miss and a warning. ``list`` returns
[]: kvstore keys are content addresses and the daemon has no listing API.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import struct
from typing import Any

import numpy as np
import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore_client.adapters._common import CLIENT_SETTINGS, Settings, escape, unescape
from kvstore_client.client import AsyncClient
from kvstore_client.errors import KVStoreClientError

log = logging.getLogger("kvstore_client.adapters.lmcache")

PLUGIN_TYPE = "kvstore"
SETTINGS = (*CLIENT_SETTINGS, "module_path", "class_name")

MAGIC = b"KVLC"
VERSION = 1
_HEAD = struct.Struct("<4sBBBBQ")  # magic, version, format, n tensors, flags, payload length
_U8 = struct.Struct("<B")
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@=+-]")
MAX_KEY = 256


# -- keys ------------------------------------------------------------------------------


def kvstore_key(lmcache_key: str) -> str:
    """The kvstore key of an LMCache key string (see the module docstring)."""
    key = "lmc." + escape(lmcache_key, _UNSAFE)
    if len(key) <= MAX_KEY:
        return key
    return "lmc~" + hashlib.blake2b(lmcache_key.encode("utf-8"), digest_size=16).hexdigest()


def lmcache_key(kvstore_key: str) -> str | None:
    """The LMCache key string of a mapped key, None for a hashed (long) one."""
    if not kvstore_key.startswith("lmc."):
        return None
    return unescape(kvstore_key[4:])


# -- values ----------------------------------------------------------------------------


class BadBlock(ValueError):
    """A stored value that is not a well-formed LMCache block."""


def encode_header(shapes: list[torch.Size], dtypes: list[torch.dtype], fmt: MemoryFormat, payload: int) -> bytes:
    if not 1 <= len(shapes) == len(dtypes) <= 255:
        raise ValueError(f"need 1 to 255 tensors with one dtype each, got {len(shapes)} shapes, {len(dtypes)} dtypes")
    parts = [_HEAD.pack(MAGIC, VERSION, fmt.value, len(shapes), 0, payload)]
    for shape, dtype in zip(shapes, dtypes, strict=True):
        name = str(dtype).removeprefix("torch.").encode("ascii")
        parts.append(_U8.pack(len(name)) + name + _U8.pack(len(shape)) + struct.pack(f"<{len(shape)}I", *shape))
    return b"".join(parts)


def decode_header(blob: bytes | memoryview) -> tuple[list[torch.Size], list[torch.dtype], MemoryFormat, int]:
    """(shapes, dtypes, format, header length); raises BadBlock."""
    if len(blob) < _HEAD.size:
        raise BadBlock(f"{len(blob)} bytes is shorter than the {_HEAD.size}-byte header")
    magic, version, fmt, n, flags, payload = _HEAD.unpack_from(blob, 0)
    if magic != MAGIC or version != VERSION:
        raise BadBlock(f"magic {magic!r} version {version}, expected {MAGIC!r} version {VERSION}")
    if flags != 0:
        raise BadBlock(f"unknown flags {flags:#x}")
    try:
        memory_format = MemoryFormat(fmt)
    except ValueError:
        raise BadBlock(f"unknown memory format {fmt}") from None
    at = _HEAD.size
    shapes: list[torch.Size] = []
    dtypes: list[torch.dtype] = []
    try:
        for _ in range(n):
            (ln,) = _U8.unpack_from(blob, at)
            name = bytes(blob[at + 1 : at + 1 + ln]).decode("ascii")
            at += 1 + ln
            (ndim,) = _U8.unpack_from(blob, at)
            dims = struct.unpack_from(f"<{ndim}I", blob, at + 1)
            at += 1 + 4 * ndim
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise BadBlock(f"unknown dtype {name!r}")
            shapes.append(torch.Size(dims))
            dtypes.append(dtype)
    except (struct.error, UnicodeDecodeError) as e:
        raise BadBlock(f"truncated or garbled tensor table: {e}") from None
    expected = sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    if payload != expected or len(blob) - at != payload:
        raise BadBlock(f"payload is {len(blob) - at} bytes, header says {payload}, shapes need {expected}")
    return shapes, dtypes, memory_format, at


# -- the connector ---------------------------------------------------------------------


class KVStoreConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache ``RemoteConnector`` on kvstore. Its coroutines run on LMCache's
    event loop (``loop``); the ``*_sync`` calls come from other threads."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
        plugin_name: str = PLUGIN_TYPE,
    ) -> None:
        super().__init__(config, metadata)
        extra = dict(getattr(config, "extra_config", None) or {})
        prefix = f"remote_storage_plugin.{plugin_name}."
        self.settings = Settings(extra, f"kvstore LMCache plugin {plugin_name!r} (extra_config)", SETTINGS, prefix)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.timeout = self.settings.get_float("timeout", 2.0)
        self.client: AsyncClient = self.settings.client()
        self._ping_client: AsyncClient = self.settings.client(strict=True, retries=0)
        self.bad_blocks = 0

    # -- sync bridges ----------------------------------------------------------------

    def _wait(self, coro: Any, default: Any) -> Any:
        """Run ``coro`` on LMCache's loop from another thread; ``default`` on failure."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # blocking here would deadlock the loop
            coro.close()
            log.warning("kvstore: a synchronous call on LMCache's event loop thread; answered as a miss")
            return default
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(self.timeout + 1.0)
        except TimeoutError:
            fut.cancel()
            log.warning("kvstore: synchronous call timed out after %s s; answered as a miss", self.timeout + 1.0)
            return default
        except Exception:  # fail-open: whatever went wrong, LMCache gets a miss
            log.exception("kvstore: synchronous call failed; answered as a miss")
            return default

    # -- existence -------------------------------------------------------------------

    async def exists(self, key: Any) -> bool:
        return await self.client.exists(kvstore_key(key.to_string()))

    def exists_sync(self, key: Any) -> bool:
        return bool(self._wait(self.exists(key), False))

    async def _prefix(self, keys: list[Any]) -> int:
        return await self.client.lookup([kvstore_key(k.to_string()) for k in keys])

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many keys from the start are stored: one lookup call."""
        return int(self._wait(self._prefix(list(keys)), 0))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return await self._prefix(list(keys))  # kvstore has no pinning: ``pin`` is ignored

    # -- reads -----------------------------------------------------------------------

    def _to_memory_obj(self, key: str, blob: bytes | None) -> Any:
        if blob is None:
            return None
        try:
            shapes, dtypes, fmt, at = decode_header(blob)
        except BadBlock as e:
            self.bad_blocks += 1
            log.warning("kvstore: block %s is not an LMCache block (%s); a miss", key, e)
            return None
        obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt)
        if obj is None:
            log.warning("kvstore: LMCache's CPU backend could not allocate %s; a miss", shapes)
            return None
        try:
            # The allocator's memory as a writable uint8 array (LocalCPUBackend: CPU memory).
            dst = obj.raw_data.view(torch.uint8).reshape(-1)[: len(blob) - at].numpy()
            if obj.get_size() != len(blob) - at or dst.nbytes != len(blob) - at:
                raise BadBlock(f"allocated {obj.get_size()} bytes for {len(blob) - at}")
            np.copyto(dst, np.frombuffer(blob, dtype=np.uint8, offset=at))
        except Exception:
            obj.ref_count_down()
            log.exception("kvstore: block %s could not be copied into LMCache's memory; a miss", key)
            return None
        return obj

    async def get(self, key: Any) -> Any:
        k = kvstore_key(key.to_string())
        return self._to_memory_obj(k, await self.client.get(k))

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        """Per key a MemoryObj or None: one ``/v1/batch/get`` per 1024 keys."""
        ks = [kvstore_key(k.to_string()) for k in keys]
        blobs = await self.client.get_many(ks)
        return [self._to_memory_obj(k, b) for k, b in zip(ks, blobs, strict=True)]

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The MemoryObjs of the longest stored prefix of ``keys`` (what LMCache's
        prefetch expects); objects after the first miss are released."""
        objs = await self.batched_get(list(keys))
        out: list[Any] = []
        for i, obj in enumerate(objs):
            if obj is None:
                for later in objs[i + 1 :]:
                    if later is not None:
                        later.ref_count_down()
                break
            out.append(obj)
        return out

    # -- writes ----------------------------------------------------------------------

    @staticmethod
    def _parts(memory_obj: Any) -> list[Any]:
        payload = memory_obj.byte_array
        header = encode_header(
            list(memory_obj.get_shapes()), list(memory_obj.get_dtypes()), memory_obj.get_memory_format(), len(payload)
        )
        return [header, payload]

    async def put(self, key: Any, memory_obj: Any) -> None:
        """Store one MemoryObj (first write wins). A failure is logged and
        counted by the client library, never raised into LMCache."""
        await self.client.put(kvstore_key(key.to_string()), b"".join(self._parts(memory_obj)))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        items = []
        for key, obj in zip(keys, memory_objs, strict=True):
            items.append((kvstore_key(key.to_string()), b"".join(self._parts(obj))))
        await self.client.put_many(items)

    # -- the rest --------------------------------------------------------------------

    def remove_sync(self, key: Any) -> bool:
        return bool(self._wait(self.client.delete(kvstore_key(key.to_string())), False))

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the daemon answers (a HEAD of a key that is never stored), 1 when not."""
        try:
            await self._ping_client.exists("lmc~ping")
        except KVStoreClientError:
            return 1
        return 0

    async def list(self) -> list[str]:
        """[]: the daemon has no listing API (keys are content addresses)."""
        return []

    async def close(self) -> None:
        await self.client.close()
        await self._ping_client.close()

    def __repr__(self) -> str:
        return f"<KVStoreConnector {self.client.endpoints}>"


class KVStoreConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """The ``ConnectorAdapter`` LMCache loads (``class_name``): it claims
    ``plugin://kvstore`` and ``plugin://kvstore.<instance>`` and builds
    :class:`KVStoreConnector` with LMCache's metadata."""

    def __init__(self) -> None:
        super().__init__("kvstore://")

    def can_parse(self, url: str) -> bool:
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://") :]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        name = context.plugin_name or PLUGIN_TYPE
        return KVStoreConnector(context.loop, context.local_cpu_backend, context.config, context.metadata, name)

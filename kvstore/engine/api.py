"""The storage engine's public API: what transports, the daemon and tools
import from the engine, and nothing else (tests/unit/test_layers.py keeps
it so). The store's operations are :class:`Store`'s methods; the rest are
the types they take and answer.
"""

from __future__ import annotations

from kvstore.engine.admission import DEFAULT_ADMIT_WINDOW_S, MAX_ADMIT_AFTER
from kvstore.engine.compactor import CompactionReport
from kvstore.engine.crypto import MasterKey, load_master_key
from kvstore.engine.format import CODEC_NAMES, FrameEntry
from kvstore.engine.lifecycle import Lease, Leases
from kvstore.engine.object_tier import node_prefix, refusal, tier_from_config
from kvstore.engine.reader import StoredFrames
from kvstore.engine.registry import adopt_registry_file
from kvstore.engine.store import Store
from kvstore.engine.types import BlockInfo, DirectExtent, LookupResult, PlannedBlock, Stored, StoredRecord, TenantStats
from kvstore.engine.verify import VerifyReport

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_ADMIT_WINDOW_S",
    "MAX_ADMIT_AFTER",
    "BlockInfo",
    "CompactionReport",
    "DirectExtent",
    "FrameEntry",
    "Lease",
    "Leases",
    "LookupResult",
    "MasterKey",
    "PlannedBlock",
    "Store",
    "Stored",
    "StoredFrames",
    "StoredRecord",
    "TenantStats",
    "VerifyReport",
    "adopt_registry_file",
    "load_master_key",
    "node_prefix",
    "refusal",
    "tier_from_config",
]

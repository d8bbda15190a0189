"""Child process of test_compaction_kill.py: run one compaction pass and die
(SIGKILL) at a chosen step.

Usage::

    KVSTORE_TEST_MASTER_KEY=<hex> python compact_killer.py DATA_DIR TIER_DIR POINT N

POINT names a step of a compaction (see :data:`KILL_POINTS`); the child dies
right after the Nth time that step completes (``before-`` points: right before
it runs). Exit 3 means the pass finished without reaching the point.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvstore.config import StoreConfig  # noqa: E402
from kvstore.engine.appender import Appender  # noqa: E402
from kvstore.engine.crypto import MasterKey  # noqa: E402
from kvstore.engine.lifecycle import Lifecycle  # noqa: E402
from kvstore.engine.segcache import SegmentCache  # noqa: E402
from kvstore.engine.store import Store  # noqa: E402
from kvstore.tier.local import LocalTier  # noqa: E402

MASTER_ENV = "KVSTORE_TEST_MASTER_KEY"
# step -> (class, method, async?)
KILL_POINTS: dict[str, tuple[type, str, bool]] = {
    "copy": (Appender, "copy", True),
    "before-copy": (Appender, "copy", True),
    "durable": (Appender, "make_durable", True),
    "seal": (Appender, "seal", True),
    "retired": (Lifecycle, "retired", False),
    "before-retired": (Lifecycle, "retired", False),
    "unlink": (SegmentCache, "forget", False),
    "object-deleted": (LocalTier, "delete", True),
    "forgotten": (Lifecycle, "deleted", False),
}


def config(data_dir: str, tier_dir: str) -> StoreConfig:
    return StoreConfig.from_env(
        data_dir,
        env={},
        segment_size="1MiB",
        frame_size="64KiB",
        tier_dir=tier_dir,
        compact_interval_s="0",
        durability="interval",
    )


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, nth: int) -> None:
    cls, name, is_async = KILL_POINTS[point]
    real: Callable[..., Any] = getattr(cls, name)
    left = [nth]
    before = point.startswith("before-")

    def due() -> bool:
        left[0] -= 1
        return left[0] == 0

    if is_async:

        @functools.wraps(real)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            if before and due():
                die()
            result = await real(*args, **kwargs)
            if not before and due():
                die()
            return result

        setattr(cls, name, wrapped_async)
    else:

        @functools.wraps(real)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before and due():
                die()
            result = real(*args, **kwargs)
            if not before and due():
                die()
            return result

        setattr(cls, name, wrapped)


async def run(data_dir: str, tier_dir: str) -> None:
    store = await Store.open(config(data_dir, tier_dir), MasterKey(bytes.fromhex(os.environ[MASTER_ENV])))
    await store.compact()
    await store.flush(upload_timeout_s=60)  # the copies are mirrored...
    await store.compact()  # ...so the old objects go
    await store.close()


def main() -> None:
    data_dir, tier_dir, point, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    install(point, nth)
    asyncio.run(run(data_dir, tier_dir))
    sys.exit(3)


if __name__ == "__main__":
    main()

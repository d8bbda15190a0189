"""An index not synced on every commit (durability = "interval").

LMDB without sync can be torn by a power loss or kernel crash, never by a
process crash (the page cache keeps every write). The store writes the boot
id to INDEX_UNSYNCED while it runs with such an index and removes it after a
clean close; a marker from another boot means the machine went down under
it, and the index is rebuilt from the segments.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.fsutil import atomic_write, fsync_dir

INDEX_UNSYNCED = "index.unsynced"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return "unknown"


def mark_index_unsynced(root: Path) -> None:
    atomic_write(root / INDEX_UNSYNCED, boot_id().encode())


def mark_index_synced(root: Path) -> None:
    marker = root / INDEX_UNSYNCED
    if marker.exists():
        marker.unlink()
        fsync_dir(root)


def index_torn_by_reboot(root: Path) -> bool:
    try:
        seen = (root / INDEX_UNSYNCED).read_text().strip()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return seen != boot_id() or seen == "unknown"

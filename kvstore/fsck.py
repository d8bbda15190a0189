"""Offline check of a data directory: recovery, then a scrub of every segment.

    .venv/bin/python -m kvstore.fsck --data-dir DIR [--shallow]

Runs with the daemon stopped (the store's lock refuses a second process).
Prints the recovery report and the scrub report as JSON; exits 0 when the
scrub found nothing wrong, 1 when it did, 2 on a start-up error. Needs the
master key (KVSTORE_MASTER_KEY_FILE) to open every frame unless --shallow,
which checks headers, footers and checksums only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from kvstore.config import StoreConfig
from kvstore.crypto import load_master_key
from kvstore.errors import KVStoreError
from kvstore.store import Store


async def run(data_dir: str, deep: bool) -> int:
    master = load_master_key(os.environ.get("KVSTORE_MASTER_KEY_FILE"), os.environ.get("KVSTORE_MASTER_KEY"))
    async with await Store.open(StoreConfig.from_env(data_dir), master) as store:
        report = await store.verify(deep=deep)
        print(json.dumps({"recovery": store.recovery.as_dict(), "verify": report.as_dict()}, indent=2))
        return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--shallow", action="store_true", help="do not open frames (no GCM/zstd check)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return asyncio.run(run(args.data_dir, deep=not args.shallow))
    except KVStoreError as e:
        print(f"kvstore fsck: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

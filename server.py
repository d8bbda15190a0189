"""kvstore's entry point.

Until the HTTP daemon lands (issue 3) this opens the store in --data-dir
(running crash recovery), prints the recovery report and every tenant's usage
as JSON, optionally scrubs every segment (--verify), and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from kvstore.config import StoreConfig
from kvstore.crypto import load_master_key
from kvstore.errors import KVStoreError
from kvstore.store import Store
from kvstore.tuning import keep_freed_memory


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="the store's data directory (created if missing)")
    p.add_argument("--create-tenant", metavar="NAME", help="create this tenant (sealed) if it does not exist")
    p.add_argument("--verify", action="store_true", help="scrub every segment, opening every frame")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> int:
    master = load_master_key(os.environ.get("KVSTORE_MASTER_KEY_FILE"), os.environ.get("KVSTORE_MASTER_KEY"))
    config = StoreConfig.from_env(args.data_dir)
    async with await Store.open(config, master) as store:
        if args.create_tenant and args.create_tenant not in {t["name"] for t in store.tenants()}:
            await store.create_tenant(args.create_tenant)
        out: dict[str, object] = {
            "data_dir": str(config.data_dir),
            "recovery": store.recovery.as_dict(),
            "tenants": {t["name"]: {**t, **vars_of(await store.stats(t["name"]))} for t in store.tenants()},
        }
        if args.verify:
            out["verify"] = (await store.verify(deep=True)).as_dict()
        print(json.dumps(out, indent=2))
        return 0 if not args.verify or out["verify"]["ok"] else 1  # type: ignore[index]


def vars_of(obj: object) -> dict[str, object]:
    return {k: getattr(obj, k) for k in getattr(obj, "__slots__", ())}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_memory()
    try:
        return asyncio.run(run(parse_args(sys.argv[1:] if argv is None else argv)))
    except KVStoreError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Set up .venv and start kvstore on a local default: data in ./local/data,
# a master key generated once in ./local/master.key (mode 0600).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup-venv.sh
mkdir -p local
if [ ! -f local/master.key ]; then
  (umask 077 && head -c 32 /dev/urandom > local/master.key)
fi
export KVSTORE_MASTER_KEY_FILE="${KVSTORE_MASTER_KEY_FILE:-$PWD/local/master.key}"
exec .venv/bin/python server.py --data-dir "${KVSTORE_DATA_DIR:-local/data}" --create-tenant default "$@"

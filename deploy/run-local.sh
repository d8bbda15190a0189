#!/usr/bin/env bash
# Set up .venv and start the kvstore daemon on a local default:
#   http://127.0.0.1:8420, data in ./local/data,
#   a master key generated once in ./local/master.key (mode 0600),
#   an admin token generated once in ./local/admin.token (mode 0600).
# Extra arguments go to `kvstore serve` and replace the defaults they name
# (e.g. --listen 127.0.0.1:9000 serves on port 9000 only).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup-venv.sh  # the daemon and ./clients (the wire formats it imports)
mkdir -p local
(umask 077
 [ -f local/master.key ] || head -c 32 /dev/urandom > local/master.key
 [ -f local/admin.token ] || .venv/bin/python -c "import secrets; print(secrets.token_urlsafe(32))" > local/admin.token)
export KVSTORE_MASTER_KEY_FILE="${KVSTORE_MASTER_KEY_FILE:-$PWD/local/master.key}"
export KVSTORE_ADMIN_TOKEN_FILE="${KVSTORE_ADMIN_TOKEN_FILE:-$PWD/local/admin.token}"
echo "admin token: $(cat "$KVSTORE_ADMIN_TOKEN_FILE")  (from $KVSTORE_ADMIN_TOKEN_FILE)"
# The defaults as settings in the environment, not as flags: a flag given here
# (--listen 127.0.0.1:9000) replaces them rather than adding a second address.
export KVSTORE_DATA_DIR="${KVSTORE_DATA_DIR:-local/data}"
export KVSTORE_LISTEN="${KVSTORE_LISTEN:-127.0.0.1:8420}"
exec .venv/bin/kvstore serve "$@"

#!/usr/bin/env bash
# Create (or update) the project's environment in .venv/ at the repository root.
# Usage: deploy/setup-venv.sh [extra]   e.g. "test" installs the test tools too.
# The daemon depends on the client distribution (kvstore-client, ./clients: the wire
# formats both speak), which is not on PyPI: both are installed in one pip call.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if [ -n "${1:-}" ]; then
  .venv/bin/python -m pip install --quiet -e ./clients -e ".[$1]"
else
  .venv/bin/python -m pip install --quiet -e ./clients -e .
fi

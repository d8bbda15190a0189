#!/usr/bin/env bash
# Set up .venv with the test tools, then lint, type-check and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup-venv.sh test
.venv/bin/python -m pip install --quiet -e clients  # the client library is its own package
export PYTHONHASHSEED="${PYTHONHASHSEED:-0}"
echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit "$rc"

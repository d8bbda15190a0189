#!/usr/bin/env bash
# Set up .venv with the test tools, then lint, type-check and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup-venv.sh test
.venv/bin/python -m pip install --quiet -e 'clients[decode]'  # the client library is its own package
export PYTHONHASHSEED="${PYTHONHASHSEED:-0}"
# One command per line: under set -e a failure on the left of && would not stop the script.
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit "$rc"

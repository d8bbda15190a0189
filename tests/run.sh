#!/usr/bin/env bash
# Set up .venv with the test tools, then lint, type-check and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup-venv.sh test
.venv/bin/python -m pip install --quiet -e 'clients[decode]'  # the client library is its own package
# NIXL for the /v1/xfer tests: --no-deps, or its wheel's metadata pulls torch and a CUDA stack.
.venv/bin/python -m pip install --quiet --no-deps nixl-cu12==1.5.1 nixl==1.5.1
# From the distribution, not PyPI: pyverbs (rdma-core; the RDMA status reports without it too),
# promtool (prometheus; checks deploy/prometheus/alerts.yml, else only their schema is checked) and
# etcd (etcd-server; the fleet's membership on etcd leases, else those tests skip).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=""
  dpkg -s python3-pyverbs >/dev/null 2>&1 || missing="$missing python3-pyverbs"
  command -v promtool >/dev/null || missing="$missing prometheus"
  command -v etcd >/dev/null || missing="$missing etcd-server"
  command -v podman >/dev/null || missing="$missing podman"  # tests/deploy: the container image
  command -v mmdebstrap >/dev/null || missing="$missing mmdebstrap"
  if [ -n "$missing" ]; then
    apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
fi
export PYTHONHASHSEED="${PYTHONHASHSEED:-0}"
# One command per line: under set -e a failure on the left of && would not stop the script.
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"
set +e
report="$(mktemp -d)/pytest.xml"
.venv/bin/python -m pytest -q -p no:cacheprovider --junitxml="$report" "$@"
rc=$?
if [ "$rc" -ne 0 ] && [ -f "$report" ]; then .venv/bin/python tests/failures.py "$report"; fi
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit "$rc"

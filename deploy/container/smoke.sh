#!/usr/bin/env bash
# Smoke-test an image that build.sh made, without `podman run` (it needs
# cgroups, which some sandboxes and CI runners lack):
#
#   deploy/container/smoke.sh localhost/kvstore:VERSION      (as root; podman, util-linux, python3)
#
# The image's root filesystem, mounted read-only (`podman image mount`), gets
# what a runtime would give it, in a private mount namespace that vanishes
# with the daemon: /proc, /dev, an empty /tmp and /run, a data directory on
# /var/lib/kvstore (uid 10001, 0700: the volume), a master key at
# /run/secrets/kvstore/master.key (0400, as `podman secret` mounts one) and a
# TOML mounted over /etc/kvstore/kvstore.toml. The image's ENTRYPOINT + CMD
# run there by chroot as the image's USER with the image's environment (plus
# the admin token and the key's path; KVSTORE_LISTEN on 127.0.0.1 and a free
# port, for the network is this host's). From this host it then checks
# /healthz and /readyz, the image's HEALTHCHECK command, creates a tenant,
# PUTs a block and GETs it back byte-exact, sees the mounted TOML's
# max_block_size refuse a larger one, checks that `kvstore --version` is the
# image's version, stops the daemon with SIGTERM and expects a clean exit.
# The root filesystem stays read-only throughout: a write outside the data
# directory, /tmp and /run fails the test. Everything is undone on any exit.
set -euo pipefail

say() { echo "smoke.sh: $*" >&2; }
die() { say "FAILED: $*"; exit 1; }

[ $# -eq 1 ] || { echo "usage: $0 IMAGE" >&2; exit 2; }
tag="$1"
[ "$(id -u)" = 0 ] || die "needs root (chroot, mount namespaces, podman image mount)"
for tool in podman unshare nsenter chroot python3; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done
podman image exists "$tag" || die "no image $tag (deploy/container/build.sh makes it)"
started=$SECONDS

scratch="$(mktemp -d "${TMPDIR:-/tmp}/kvstore-smoke.XXXXXX")"
rootfs="" pid=""
cleanup() {
  local rc=$?
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  if [ "$rc" -ne 0 ] && [ -s "$scratch/daemon.log" ]; then
    say "the daemon's output:"; tail -n 40 "$scratch/daemon.log" >&2
  fi
  [ -z "$rootfs" ] || podman image unmount "$tag" >/dev/null || say "podman image unmount $tag failed"
  rm -rf "$scratch"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- What the image says about itself -----------------------------------------
podman image inspect --format '{{json .Config}}' "$tag" >"$scratch/config.json"
podman image inspect --format '{{json .HealthCheck}}' "$tag" >"$scratch/healthcheck.json"
# One file per list, NUL-separated: the environment, ENTRYPOINT + CMD, the HEALTHCHECK's command.
python3 - "$scratch" <<'EOF' || die "the image's configuration is not the one agreed on"
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
cfg = json.loads((d / "config.json").read_text())
hc = json.loads((d / "healthcheck.json").read_text()) or {}
env = dict(e.split("=", 1) for e in cfg.get("Env") or [])
want = {
    "KVSTORE_DATA_DIR": "/var/lib/kvstore",
    "KVSTORE_LISTEN": "0.0.0.0:8420",
    "KVSTORE_CONFIG": "/etc/kvstore/kvstore.toml",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}
problems = [f"{k}={env.get(k)!r}, expected {v!r}" for k, v in want.items() if env.get(k) != v]
if not env.get("PATH", "").startswith("/opt/kvstore/.venv/bin:"):
    problems.append(f"PATH={env.get('PATH')!r} does not start with the venv's bin")
for key, value in {"User": "10001:10001", "Entrypoint": ["kvstore"], "Cmd": ["serve"]}.items():
    if cfg.get(key) != value:
        problems.append(f"{key}={cfg.get(key)!r}, expected {value!r}")
if "/var/lib/kvstore" not in (cfg.get("Volumes") or {}):
    problems.append(f"Volumes={cfg.get('Volumes')!r} lacks /var/lib/kvstore")
if "8420/tcp" not in (cfg.get("ExposedPorts") or {}):
    problems.append(f"ExposedPorts={cfg.get('ExposedPorts')!r} lacks 8420/tcp")
test = hc.get("Test") or []
if test[:1] != ["CMD"] or len(test) < 2:
    problems.append(f"HealthCheck={hc!r}: expected a CMD (was the image built with --format docker?)")
for p in problems:
    print("smoke.sh:", p, file=sys.stderr)
(d / "env").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in env.items()))
(d / "command").write_bytes(b"".join(f"{a}\0".encode() for a in cfg["Entrypoint"] + cfg["Cmd"]))
(d / "healthcheck").write_bytes(b"".join(f"{a}\0".encode() for a in test[1:]))
sys.exit(1 if problems else 0)
EOF
mapfile -d '' image_env <"$scratch/env"
mapfile -d '' command <"$scratch/command"
mapfile -d '' healthcheck <"$scratch/healthcheck"
user="$(podman image inspect --format '{{.Config.User}}' "$tag")"
version="$(podman image inspect --format '{{index .Labels "org.opencontainers.image.version"}}' "$tag")"
[ -n "$version" ] || die "the image has no org.opencontainers.image.version label"

rootfs="$(podman image mount "$tag")"
[ -d "$rootfs/opt/kvstore/.venv" ] || die "podman image mount $tag gave $rootfs, which has no /opt/kvstore/.venv"
if touch "$rootfs/.smoke-rw" 2>/dev/null; then
  rm -f "$rootfs/.smoke-rw"
  die "podman image mount gave a writable root filesystem: the read-only root would go untested"
fi

# --- The root filesystem's own promises ----------------------------------------
[ "$(stat -c '%u:%g %a' "$rootfs/var/lib/kvstore")" = "10001:10001 700" ] \
  || die "/var/lib/kvstore is $(stat -c '%u:%g %a' "$rootfs/var/lib/kvstore"), expected 10001:10001 700"
grep -qx 'kvstore:x:10001:10001::/nonexistent:/usr/sbin/nologin' "$rootfs/etc/passwd" \
  || die "no user kvstore 10001:10001 without a login shell in /etc/passwd: $(grep kvstore "$rootfs/etc/passwd")"
cmp -s "$rootfs/etc/kvstore/kvstore.toml" "$(echo "$rootfs"/opt/kvstore/.venv/lib/python3*/site-packages/kvstore/kvstore.toml)" \
  || die "/etc/kvstore/kvstore.toml is not the package's kvstore.toml"
for absent in gcc cc curl pip pip3; do
  if [ -e "$rootfs/usr/bin/$absent" ] || [ -e "$rootfs/opt/kvstore/.venv/bin/$absent" ]; then
    die "the image has $absent"
  fi
done

# --- Run in the image --------------------------------------------------------------
install -d -m 0700 -o 10001 -g 10001 "$scratch/data"
install -d -m 1777 "$scratch/tmp"
install -d -m 0755 "$scratch/run" "$scratch/run/secrets"
install -d -m 0500 -o 10001 -g 10001 "$scratch/run/secrets/kvstore"
(umask 077 && head -c 32 /dev/urandom >"$scratch/run/secrets/kvstore/master.key")
chown 10001:10001 "$scratch/run/secrets/kvstore/master.key"
chmod 0400 "$scratch/run/secrets/kvstore/master.key"
admin="$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# A mounted config file replaces the image's: its max_block_size is seen below.
printf 'max_block_size = "1MiB"\nworkers = 2\n' >"$scratch/kvstore.toml"
chmod 0644 "$scratch/kvstore.toml"
run_env=("${image_env[@]}" "HOME=/nonexistent" "KVSTORE_LISTEN=127.0.0.1:$port"
         "KVSTORE_ADMIN_TOKEN=$admin" "KVSTORE_MASTER_KEY_FILE=/run/secrets/kvstore/master.key")

# in_image CMD...: CMD in the image's root as its USER, in a mount namespace of
# its own. It execs: call it in a subshell, `(in_image ...)`, `$(in_image ...)`
# or `in_image ... &`, whose pid is then CMD's (unshare, sh and chroot exec too).
in_image() {
  [ "$BASH_SUBSHELL" -gt 0 ] || die "in_image must run in a subshell"
  exec env -i "${run_env[@]}" unshare --mount --propagation private -- /bin/sh -ec '
    r=$1 s=$2 u=$3; shift 3
    mount --bind /proc "$r/proc"
    mount --rbind /dev "$r/dev"
    mount --bind "$s/tmp" "$r/tmp"
    mount --bind "$s/run" "$r/run"
    mount --bind "$s/data" "$r/var/lib/kvstore"
    mount --bind "$s/kvstore.toml" "$r/etc/kvstore/kvstore.toml"
    exec chroot --userspec="$u" "$r" "$@"' in_image "$rootfs" "$scratch" "$user" "$@"
}

got="$(in_image kvstore --version)" || die "kvstore --version failed"
[ "$got" = "kvstore $version" ] || die "kvstore --version printed '$got', expected 'kvstore $version'"
# Every compiled dependency loads (the wheels are the image's CPU's).
(in_image python -c 'import aiohttp, awscrt, cryptography.hazmat.bindings._rust, lmdb, msgpack, numpy, uvloop, xxhash, zmq, zstandard') \
  || die "a compiled dependency does not import"

image_arch="$(podman image inspect --format '{{.Architecture}}' "$tag")"
host_arch="$(podman info --format '{{.Host.Arch}}')"
if [ "$image_arch" != "$host_arch" ]; then
  # Another CPU's image runs under qemu-user. QEMU (7.2, Debian bookworm's)
  # maps a file mapping longer than its file as shared anonymous memory,
  # which the kernel accounts: the index's 64 GiB LMDB map is refused
  # (ENOMEM) unless overcommit allows it. Natively the map costs nothing.
  mode="$(cat /proc/sys/vm/overcommit_memory)"
  total_kib="$(awk '/^(MemTotal|SwapTotal):/ {t += $2} END {print t}' /proc/meminfo)"
  if [ "$mode" != 1 ] && { [ "$mode" = 2 ] || [ "$total_kib" -lt $((66 << 20)) ]; }; then
    say "ok, without serving: $tag ($image_arch) runs under qemu-user here, which cannot map the index's 64 GiB" \
      "with vm.overcommit_memory=$mode and $((total_kib >> 20)) GiB of memory + swap" \
      "(run with vm.overcommit_memory=1 for the whole test)"
    exit 0
  fi
fi

say "starting ${command[*]} in $tag on 127.0.0.1:$port"
in_image "${command[@]}" >"$scratch/daemon.log" 2>&1 &
pid=$!
deadline=$((SECONDS + 120))
until grep -q "kvstore serving on http://127.0.0.1:$port" "$scratch/daemon.log"; do
  kill -0 "$pid" 2>/dev/null || die "the daemon exited before it served"
  [ "$SECONDS" -lt "$deadline" ] || die "the daemon did not serve within 120 s"
  sleep 0.2
done
say "serving after $((SECONDS - started)) s"

# The HEALTHCHECK's command, where the daemon runs (its namespace, user and environment).
env -i "${run_env[@]}" nsenter --mount --target "$pid" -- chroot --userspec="$user" "$rootfs" "${healthcheck[@]}" \
  || die "the HEALTHCHECK command (${healthcheck[*]}) failed"

python3 - "127.0.0.1:$port" "$admin" <<'EOF' || die "the HTTP checks failed"
import json, os, sys, urllib.error, urllib.request

base, admin = f"http://{sys.argv[1]}", sys.argv[2]

def call(method, path, token=None, body=None, json_body=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if json_body is not None:
        body, headers["Content-Type"] = json.dumps(json_body).encode(), "application/json"
    req = urllib.request.Request(base + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()

def expect(what, got, want):
    if got != want:
        sys.exit(f"smoke.sh: {what}: {got!r}, expected {want!r}")

expect("GET /healthz", call("GET", "/healthz")[0], 200)
expect("GET /readyz", call("GET", "/readyz")[0], 200)
status, body = call("POST", "/v1/admin/tenants", admin, json_body={"name": "smoke"})
expect("POST /v1/admin/tenants", status, 201)
token = json.loads(body)["token"]
block = os.urandom(256 * 1024 + 7)
expect("PUT /v1/blocks/smoke-0", call("PUT", "/v1/blocks/smoke-0", token, block)[0] // 100, 2)
status, got = call("GET", "/v1/blocks/smoke-0", token)
expect("GET /v1/blocks/smoke-0", status, 200)
expect("the block read back equals the block written", got == block, True)
expect("GET of a block never written", call("GET", "/v1/blocks/smoke-none", token)[0], 404)
status, body = call("PUT", "/v1/blocks/smoke-big", token, os.urandom((1 << 20) + 1))
expect("PUT of 1 MiB + 1 byte (the mounted TOML's max_block_size = 1MiB)", status, 413)
expect("without a token", call("GET", "/v1/blocks/smoke-0")[0], 401)
print(f"smoke.sh: HTTP ok: tenant created, {len(block)} bytes put and read back, 1 MiB + 1 refused", file=sys.stderr)
EOF

say "stopping the daemon (SIGTERM)"
kill -TERM "$pid"
deadline=$((SECONDS + 60))
while kill -0 "$pid" 2>/dev/null; do
  [ "$SECONDS" -lt "$deadline" ] || die "the daemon did not exit within 60 s of SIGTERM"
  sleep 0.2
done
rc=0
wait "$pid" || rc=$?
pid=""
[ "$rc" -eq 0 ] || die "the daemon exited with $rc after SIGTERM"
if grep -q Traceback "$scratch/daemon.log"; then die "the daemon's output has a traceback"; fi
[ -n "$(find "$scratch/data" -mindepth 1 -user 10001 -print -quit)" ] || die "nothing written to the data volume"
[ -z "$(find "$scratch/data" -mindepth 1 ! -user 10001 -print -quit)" ] || die "files in the data volume not owned by 10001"
say "ok: $tag (kvstore $version) in $((SECONDS - started)) s"

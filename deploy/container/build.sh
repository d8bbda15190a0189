#!/usr/bin/env bash
# Build kvstore's container image from this checkout, with podman (or buildah),
# from Debian's packages and PyPI alone; print its tag on the last line.
#
#   deploy/container/build.sh [--arch amd64|arm64] [--base IMAGE] [--refresh-base]
#
#   --arch          the image's CPU (default: this machine's). Another CPU's
#                   needs qemu-user-static with binfmt_misc (Debian:
#                   qemu-user-static binfmt-support, and arch-test for mmdebstrap).
#   --base IMAGE    a Debian bookworm image to build on (default: the
#                   Containerfile's BASE, docker.io/library/debian:bookworm-slim,
#                   where it is here or can be pulled; else build.sh's own).
#   --refresh-base  pull or make the base again (Debian's security updates).
#
# Tags: localhost/kvstore:VERSION (this machine's CPU) or
# localhost/kvstore:VERSION-ARCH (another's); VERSION is kvstore.__version__
# ('+' written '-': an image tag has no '+').
#
# Steps: (1) the two wheels, built from a clean copy of the working tree
# (tracked and untracked files that git does not ignore; a stale build/ never
# gets into them), reproducibly (SOURCE_DATE_EPOCH) so that an unchanged tree
# reuses the cached image layers; (2) a wheel of every dependency for the
# image's CPU and Python, from the index pip is configured with
# (deploy/container/wheels.py fetch); (3) the base: BASE if present or pulled
# within KVSTORE_PULL_TIMEOUT_S (20 s), else localhost/kvstore-base:bookworm[-ARCH],
# reused when it exists, made once with mmdebstrap (minbase + python3,
# python3-venv, ca-certificates; Debian's mirror, or KVSTORE_DEBIAN_MIRROR: a
# URI, a "deb ..." line or a sources file, as mmdebstrap takes them) and
# imported; (4) the image (Containerfile), with --isolation chroot unless
# BUILDAH_ISOLATION says otherwise (chroot needs no cgroups) and --format docker
# (the OCI format drops HEALTHCHECK). Progress goes to stderr, the tag alone to
# stdout. Environment: PYTHON (the host's Python with pip: .venv's if present,
# else python3), KVSTORE_ENGINE (podman or buildah).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
default_base="docker.io/library/debian:bookworm-slim"
suite="bookworm"

say() { echo "build.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

arch="" base="" refresh=0
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) [ $# -ge 2 ] || die "--arch needs a value"; arch="$2"; shift 2 ;;
    --arch=*) arch="${1#--arch=}"; shift ;;
    --base) [ $# -ge 2 ] || die "--base needs a value"; base="$2"; shift 2 ;;
    --base=*) base="${1#--base=}"; shift ;;
    --refresh-base) refresh=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

# --- Tools -------------------------------------------------------------------
engine="${KVSTORE_ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v podman >/dev/null; then engine=podman
  elif command -v buildah >/dev/null; then engine=buildah
  else die "neither podman nor buildah is installed (Debian: apt-get install podman)"; fi
fi
case "$engine" in podman|buildah) ;; *) die "KVSTORE_ENGINE=$engine: expected podman or buildah" ;; esac
command -v "$engine" >/dev/null || die "$engine is not installed"

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip (set PYTHON to a Python with pip)"

# Debian's architecture names (the image's and mmdebstrap's) and the wheels'.
native="$(uname -m)"
case "$native" in x86_64) native=amd64 ;; aarch64) native=arm64 ;; esac
arch="${arch:-$native}"
case "$arch" in
  amd64|x86_64) arch=amd64; wheel_arch=x86_64 ;;
  arm64|aarch64) arch=arm64; wheel_arch=aarch64 ;;
  *) die "--arch $arch: expected amd64 or arm64" ;;
esac
suffix=""
if [ "$arch" != "$native" ]; then
  suffix="-$arch"
  qemu="/proc/sys/fs/binfmt_misc/qemu-$wheel_arch"
  if [ ! -e "$qemu" ] || ! grep -qx enabled "$qemu"; then
    die "--arch $arch on $native needs qemu-user-static registered with binfmt_misc ($qemu is missing or disabled; Debian: apt-get install qemu-user-static binfmt-support)"
  fi
fi

image_exists() {
  if [ "$engine" = podman ]; then podman image exists "$1"; else buildah inspect --type image "$1" >/dev/null 2>&1; fi
}
image_id() {
  if [ "$engine" = podman ]; then podman image inspect --format '{{.Id}}' "$1" 2>/dev/null
  else buildah inspect --type image --format '{{.FromImageID}}' "$1" 2>/dev/null; fi
}
image_arch() {
  if [ "$engine" = podman ]; then podman image inspect --format '{{.Architecture}}' "$1"
  else buildah inspect --type image --format '{{.OCIv1.Architecture}}' "$1"; fi
}

# --- (1) the two wheels --------------------------------------------------------
work="$(mktemp -d "${TMPDIR:-/tmp}/kvstore-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/own" "$work/context/wheels"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Files deleted in the working tree are still in the index: skip them.
  (cd "$root" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi; done \
    | tar --null -T - -cf -) | tar -C "$work/src" -xf -
  # The copy has no .git: its wheels take the version and commit the checkout builds as
  # (clients/build_version.py, from git), found by building the client's wheel here once.
  "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$work/probe" "$root/clients" >&2
  probe="$(echo "$work"/probe/kvstore_client-*-py3-none-any.whl)"
  [ -f "$probe" ] || die "pip wheel made no kvstore_client wheel of the checkout"
  export SETUPTOOLS_SCM_PRETEND_VERSION="$(basename "$probe" | cut -d- -f2)"
  export SETUPTOOLS_SCM_PRETEND_METADATA="{node=\"g$(git -C "$root" rev-parse HEAD)\"}"
else
  tar -C "$root" --exclude=./.venv --exclude=./build --exclude=./dist --exclude='*.egg-info' -cf - . \
    | tar -C "$work/src" -xf -
fi
say "building the wheels"
SOURCE_DATE_EPOCH=315532800 "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps \
  -w "$work/own" "$work/src" "$work/src/clients" >&2
server_whl="$(echo "$work"/own/kvstore_server-*-py3-none-any.whl)"
client_whl="$(echo "$work"/own/kvstore_client-*-py3-none-any.whl)"
[ -f "$server_whl" ] && [ -f "$client_whl" ] || die "pip wheel made no kvstore_server/kvstore_client wheel"
version="$(basename "$server_whl" | cut -d- -f2)"
[ "$(basename "$client_whl" | cut -d- -f2)" = "$version" ] \
  || die "kvstore-server $version and kvstore-client $(basename "$client_whl" | cut -d- -f2) differ: the image needs one version"
tag="localhost/kvstore:${version//+/-}$suffix"  # an image tag has no '+': 0.2.0.dev5+g1a2b3c4 -> 0.2.0.dev5-g1a2b3c4

# --- (2) every dependency's wheel, for the image's CPU and Python -------------
say "fetching the dependencies' wheels for CPython 3.11 on $wheel_arch"
"$PYTHON" "$here/wheels.py" fetch --arch "$wheel_arch" --python 3.11 --glibc 2.36 \
  --dest "$work/context/wheels" "$server_whl" "$client_whl" \
  || die "some dependency has no wheel for CPython 3.11 on $wheel_arch (deploy/container/wheels.py check)"
cp "$here/healthcheck.py" "$work/context/"

# --- (3) the base ------------------------------------------------------------
own_base="localhost/kvstore-base:$suite$suffix"
make_base() {
  command -v mmdebstrap >/dev/null || die "$default_base cannot be pulled and mmdebstrap is not installed (Debian: apt-get install mmdebstrap)"
  if [ "$arch" != "$native" ]; then
    command -v arch-test >/dev/null || die "mmdebstrap --arch $arch needs arch-test (Debian: apt-get install arch-test)"
  fi
  say "making $own_base with mmdebstrap (Debian $suite $arch, minbase + python3)"
  local mirrors=()
  if [ -n "${KVSTORE_DEBIAN_MIRROR:-}" ]; then
    mirrors=("$KVSTORE_DEBIAN_MIRROR")
  else
    # The same mirrors as Debian's images (and this machine's apt): the
    # release, its updates and its security updates.
    mirrors=("deb http://deb.debian.org/debian $suite main"
             "deb http://deb.debian.org/debian $suite-updates main"
             "deb http://deb.debian.org/debian-security $suite-security main")
  fi
  # Slim, as debian:*-slim is: no manuals, documentation (but copyrights) or
  # translations. Merged /usr by the hook (not the usrmerge package, which
  # pulls perl in). The host's resolv.conf and hostname do not belong in an
  # image: the runtime provides both.
  mmdebstrap --variant=minbase --arch="$arch" \
    --include=python3,python3-venv,ca-certificates \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -f "$1/etc/resolv.conf" "$1/etc/hostname"' \
    "$suite" "$work/rootfs.tar" "${mirrors[@]}" >&2 || die "mmdebstrap failed"
  if [ "$engine" = podman ]; then
    podman import --arch "$arch" --os linux --message "Debian $suite minbase + python3 (mmdebstrap)" \
      --change 'CMD ["/bin/bash"]' "$work/rootfs.tar" "$own_base" >&2 || die "podman import failed"
  else
    local ctr
    ctr="$(buildah from --arch "$arch" scratch)"
    buildah add "$ctr" "$work/rootfs.tar" / >&2 && buildah config --arch "$arch" --os linux --cmd /bin/bash "$ctr" \
      && buildah commit --rm "$ctr" "$own_base" >&2 || { buildah rm "$ctr" >/dev/null 2>&1; die "buildah import failed"; }
  fi
  rm -f "$work/rootfs.tar"
}

pull() {
  # A registry that cannot be reached fails at once or hangs on its TCP
  # connection: bounded either way.
  local cmd=("$engine" pull --arch "$arch" "$1")
  [ "$engine" = podman ] || cmd=(buildah pull --arch "$arch" "$1")
  timeout "${KVSTORE_PULL_TIMEOUT_S:-20}" "${cmd[@]}" >&2
}

if [ -n "$base" ]; then
  if [ "$refresh" = 1 ] || ! image_exists "$base"; then
    say "pulling $base"; pull "$base" || die "cannot pull --base $base"
  fi
  [ "$(image_arch "$base")" = "$arch" ] || die "--base $base is $(image_arch "$base"), not $arch"
elif [ "$refresh" = 0 ] && image_exists "$default_base" && [ "$(image_arch "$default_base")" = "$arch" ]; then
  base="$default_base"
elif [ "$refresh" = 0 ] && image_exists "$own_base"; then
  base="$own_base"
elif say "pulling $default_base ($arch)" && pull "$default_base" && [ "$(image_arch "$default_base")" = "$arch" ]; then
  base="$default_base"
else
  say "$default_base ($arch) cannot be pulled: making the base from Debian's packages"
  make_base
  base="$own_base"
fi
say "base: $base ($(image_arch "$base"))"

# --- (4) the image -------------------------------------------------------------
# The build stage (the venv) is tagged too, localhost/kvstore-build:ARCH: it is
# the layer cache that makes a rebuild of an unchanged tree the same image, and
# the tag lets the images a rebuild supersedes be removed (below) instead of
# piling up as <none> on a CI machine.
stage="localhost/kvstore-build:$arch"
superseded=("$(image_id "$tag" || true)" "$(image_id "$stage" || true)")
build=("$engine" build)
[ "$engine" = podman ] || build=(buildah build)
build+=(--isolation "${BUILDAH_ISOLATION:-chroot}" --format docker --arch "$arch" --pull=never
        --build-arg "BASE=$base" --build-arg "VERSION=$version" --file "$here/Containerfile")
say "building $stage (the virtualenv)"
"${build[@]}" --target venv --tag "$stage" "$work/context" >&2 || die "$engine build (the build stage) failed"
say "building $tag"
"${build[@]}" --tag "$tag" "$work/context" >&2 || die "$engine build failed"
[ "$(image_arch "$tag")" = "$arch" ] || die "$tag is $(image_arch "$tag"), not $arch"
current=("$(image_id "$tag")" "$(image_id "$stage")")
for old in "${superseded[@]}"; do
  # An image this build replaced, now untagged: removed with its untagged parents.
  if [ "$engine" = podman ] && [ -n "$old" ] && [[ " ${current[*]} " != *" $old "* ]] \
      && [ "$(podman image inspect --format '{{len .RepoTags}}' "$old" 2>/dev/null)" = 0 ]; then
    podman rmi "$old" >/dev/null 2>&1 || say "could not remove the superseded image $old"
  fi
done
echo "$tag"

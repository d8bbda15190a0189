"""The container image (deploy/container/): build.sh builds it from Debian's
packages and PyPI alone, smoke.sh runs the daemon in its read-only root
filesystem (``podman image mount`` + chroot: ``podman run`` needs cgroups,
which this sandbox and some CI runners lack) and puts and gets a block.

Needs root, podman and mmdebstrap (Debian: ``apt-get install podman
mmdebstrap``; tests/run.sh installs them when run as root), and skips without
them. The arm64 image also needs qemu-user-static registered with binfmt_misc
and arch-test (``apt-get install qemu-user-static binfmt-support arch-test``),
and skips without. Times on 2 cores: the first build, with the base made by
mmdebstrap, about 45 s (amd64) and 2 min 40 s (arm64, emulated); a rebuild
of an unchanged tree about 11 s; a smoke test 2 s (8 s emulated).
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvstore import __version__

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "container" / "build.sh"
SMOKE = ROOT / "deploy" / "container" / "smoke.sh"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@functools.cache
def _needs() -> str | None:
    """Why this machine cannot build and run the image, or None."""
    if os.geteuid() != 0:
        return "needs root (podman build --isolation chroot, podman image mount, chroot)"
    missing = [tool for tool in ("podman", "mmdebstrap", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (Debian: apt-get install podman mmdebstrap; tests/run.sh does as root)"
    info = subprocess.run(["podman", "info"], capture_output=True, text=True, timeout=120)
    if info.returncode != 0:
        # e.g. inside an unprivileged container: no overlay, no mounts (STORAGE_DRIVER=vfs may help).
        return f"podman cannot run here: {(info.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def _needs_arm64() -> str | None:
    if platform.machine() != "x86_64":
        return f"the arm64 image is built under emulation on x86_64 hosts; this one is {platform.machine()}"
    qemu = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not qemu.exists() or "enabled" not in qemu.read_text():
        return "needs qemu-user-static registered with binfmt_misc (apt-get install qemu-user-static binfmt-support)"
    if shutil.which("arch-test") is None:
        return "mmdebstrap --arch arm64 needs arch-test (apt-get install arch-test)"
    return None


def _run(cmd: list[str]) -> tuple[str, float]:
    """Run ``cmd``; its stdout and seconds taken. Its stderr (the build's log)
    is shown when it fails."""
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    took = time.monotonic() - start
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-6000:]}"
    return out.stdout, took


def _image_id(tag: str) -> str:
    return subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True, check=True
    ).stdout.strip()


def _report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n  {line}", flush=True)


@pytest.mark.skipif(_needs() is not None, reason=_needs() or "")
def test_image_builds_twice_to_the_same_image_and_serves(capsys: pytest.CaptureFixture[str]) -> None:
    out, first = _run([str(BUILD)])
    tag = out.strip().splitlines()[-1]
    assert tag == f"localhost/kvstore:{__version__.replace('+', '-')}"
    image = _image_id(tag)
    # build.sh is idempotent: an unchanged tree gives the same image (reproducible
    # wheels, the base reused, every layer from the cache).
    out, again = _run([str(BUILD)])
    assert out.strip().splitlines()[-1] == tag
    assert _image_id(tag) == image
    _, smoke = _run([str(SMOKE), tag])
    _report(capsys, f"container image {tag}: build {first:.0f} s, rebuild {again:.0f} s, smoke test {smoke:.0f} s")


@pytest.mark.skipif(_needs() is not None or _needs_arm64() is not None, reason=_needs() or _needs_arm64() or "")
def test_arm64_image(capsys: pytest.CaptureFixture[str]) -> None:
    out, took = _run([str(BUILD), "--arch", "arm64"])
    tag = out.strip().splitlines()[-1]
    assert tag == f"localhost/kvstore:{__version__.replace('+', '-')}-arm64"
    arch = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Architecture}}", tag], capture_output=True, text=True
    ).stdout.strip()
    assert arch == "arm64"
    start = time.monotonic()
    smoke = subprocess.run([str(SMOKE), tag], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert smoke.returncode == 0, smoke.stderr[-6000:]
    said = smoke.stderr.strip().splitlines()[-1]
    _report(capsys, f"container image {tag}: build {took:.0f} s, smoke test {time.monotonic() - start:.0f} s: {said}")

#!/usr/bin/env python3
"""The wheels the image installs, for any architecture, and which exist.

``fetch`` puts the two wheels of this repository and a wheel of every
dependency into one folder, for a target architecture, CPython version and
glibc: ``pip download --only-binary :all:`` with every manylinux tag that
glibc accepts (pip does not widen an explicit ``--platform`` to the older
manylinux tags, so ``--platform manylinux2014_aarch64`` alone misses the
wheels tagged only ``manylinux_2_28_aarch64``, and the other way round).
build.sh runs it on the host, so the image build itself needs no network and
no emulated pip: ``pip install --no-index`` from that folder.

``check`` answers "can every dependency install from a wheel?" for each
supported CPython on x86_64 and aarch64: what pip picks for a glibc 2.36 host
(Debian bookworm, the image's base) and whether everything still installs on
a manylinux2014 (glibc 2.17) host. It prints a table and exits 1 if any
dependency lacks a wheel on the image's glibc. It asks the index pip is
configured with; it takes a minute or two from pip's cache.

    deploy/container/wheels.py fetch --arch aarch64 --python 3.11 --dest DIR dist/*.whl
    deploy/container/wheels.py check dist/*.whl
"""

from __future__ import annotations

import argparse
import email.parser
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ARCHES = ("x86_64", "aarch64")
PYTHONS = ("3.11", "3.12", "3.13", "3.14")  # requires-python >= 3.11; 3.14 is the newest CPython
IMAGE_GLIBC = (2, 36)  # Debian bookworm
OLDEST_GLIBC = (2, 17)  # manylinux2014: CentOS 7, Ubuntu 14.04 and anything newer
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
_MISSING = re.compile(r"No matching distribution found for ([A-Za-z0-9._-]+)")


def platforms(arch: str, glibc: tuple[int, int]) -> list[str]:
    """Every manylinux tag a host of ``arch`` with ``glibc`` accepts, newest first."""
    major, minor = glibc
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    tags += [f"{name}_{arch}" for name, floor in _LEGACY.items() if floor <= glibc]
    return tags


def glibc_floor(wheel: str) -> tuple[int, int] | None:
    """The oldest glibc a wheel's platform tags accept; None for a pure wheel."""
    plats = wheel.removesuffix(".whl").split("-")[-1].split(".")
    floors = []
    for plat in plats:
        if plat == "any":
            return None
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", plat)
        if m:
            floors.append((int(m[1]), int(m[2])))
        elif plat.split("_")[0] in _LEGACY:
            floors.append(_LEGACY[plat.split("_")[0]])
    return min(floors) if floors else (0, 0)


def pip_download(
    python: str, arch: str, glibc: tuple[int, int], reqs: list[str], dest: Path, *, deps: bool = True
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    cmd += ["--only-binary", ":all:", "--implementation", "cp", "--python-version", python]
    cmd += [arg for tag in platforms(arch, glibc) for arg in ("--platform", tag)]
    cmd += ["--dest", str(dest)] + ([] if deps else ["--no-deps"])
    return subprocess.run([*cmd, *reqs], capture_output=True, text=True, timeout=900)


def fetch(args: argparse.Namespace) -> int:
    args.dest.mkdir(parents=True, exist_ok=True)
    out = pip_download(args.python, args.arch, args.glibc, [str(w) for w in args.wheels], args.dest)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        print(f"wheels.py: no wheel for CPython {args.python} on {args.arch} glibc {show(args.glibc)}", file=sys.stderr)
    return out.returncode


def requirements(wheels: list[Path]) -> dict[str, str]:
    """The wheels' own dependencies (name -> requirement), without extras'."""
    reqs: dict[str, str] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            msg = email.parser.Parser().parsestr(z.read(meta).decode())
        for req in msg.get_all("Requires-Dist") or []:
            if "extra ==" not in req:
                name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]
                reqs[canonical(name)] = req
    return reqs


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_name(wheel: str) -> str:
    return canonical(wheel.split("-")[0])


def show(floor: tuple[int, int] | None) -> str:
    return "any" if floor is None else f"{floor[0]}.{floor[1]}"


def check(args: argparse.Namespace) -> int:
    own = {dist_name(w.name) for w in args.wheels}
    top = requirements(args.wheels)
    picked: dict[tuple[str, str], dict[str, str]] = {}
    notes: list[str] = []
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for python in args.python:
            for arch in args.arch:
                col = (python, arch)
                dest = Path(tmp) / f"{python}-{arch}"
                out = pip_download(python, arch, IMAGE_GLIBC, [str(w) for w in args.wheels], dest)
                if out.returncode != 0:
                    failed = True
                    missing = _missing_each(python, arch, IMAGE_GLIBC, top, own, Path(tmp) / "each")
                    notes.append(f"CPython {python} {arch} glibc {show(IMAGE_GLIBC)}: no wheel for {missing}")
                    continue
                picked[col] = {}
                floor: tuple[int, int] = (0, 0)
                for w in sorted(p.name for p in dest.iterdir()):
                    name, version = dist_name(w), w.split("-")[1]
                    if name in own:
                        continue
                    f = glibc_floor(w)
                    floor = max(floor, f or (0, 0))
                    picked[col][name] = f"{version} ({show(f)})"
                old = pip_download(python, arch, OLDEST_GLIBC, [str(w) for w in args.wheels], Path(tmp) / "old")
                if old.returncode == 0:
                    older = sorted(
                        f"{dist_name(p.name)} {p.name.split('-')[1]}"
                        for p in (Path(tmp) / "old").iterdir()
                        if dist_name(p.name) not in own and p.name.split("-")[1] != _version(picked[col], p.name)
                    )
                    also = f", with older {', '.join(older)}" if older else ""
                    notes.append(
                        f"CPython {python} {arch}: newest need glibc >= {show(floor)}; glibc 2.17 installs too{also}"
                    )
                else:
                    missing = _missing_each(python, arch, OLDEST_GLIBC, top, own, Path(tmp) / "each")
                    notes.append(
                        f"CPython {python} {arch}: newest need glibc >= {show(floor)};"
                        f" on glibc 2.17 no wheel for {missing}"
                    )
                for p in (Path(tmp) / "old").glob("*"):
                    p.unlink()
    cols = sorted(picked)
    names = sorted({n for c in cols for n in picked[c]})
    width = max([len(n) for n in names] + [10])
    cells = {c: max([len(v) for v in picked[c].values()] + [len(" ".join(c))]) for c in cols}
    print("wheel picked for a glibc 2.36 host: version (oldest glibc its wheel accepts; any = pure Python)")
    print(f"{'':{width}} " + " ".join(f"{' '.join(c):{cells[c]}}" for c in cols))
    for n in names:
        print(f"{n:{width}} " + " ".join(f"{picked[c].get(n, '-'):{cells[c]}}" for c in cols))
    print()
    print("\n".join(notes))
    return 1 if failed else 0


def _version(picked: dict[str, str], wheel: str) -> str:
    return picked.get(dist_name(wheel), "").split(" ")[0]


def _missing_each(
    python: str, arch: str, glibc: tuple[int, int], top: dict[str, str], own: set[str], dest: Path
) -> str:
    """Which of the direct dependencies have no wheel at all (each asked alone;
    a dependency of theirs that lacks one is named by pip's message)."""
    missing = []
    for name, req in sorted(top.items()):
        if name in own:
            continue
        out = pip_download(python, arch, glibc, [req.split(";")[0]], dest)
        if out.returncode != 0:
            m = _MISSING.search(out.stderr)
            missing.append(m[1] if m and canonical(m[1]) != name else name)
    return ", ".join(sorted(set(missing))) or "(none alone: the versions conflict)"


def glibc_version(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MAJOR.MINOR, such as 2.36")
    return int(m[1]), int(m[2])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download every wheel the image installs into --dest")
    f.add_argument("--arch", choices=ARCHES, required=True)
    f.add_argument("--python", default="3.11", help="CPython version, MAJOR.MINOR (default 3.11, bookworm's)")
    f.add_argument(
        "--glibc", type=glibc_version, default=IMAGE_GLIBC, help="the target's glibc (default 2.36, bookworm's)"
    )
    f.add_argument("--dest", type=Path, required=True)
    f.add_argument("wheels", type=Path, nargs="+", help="kvstore_server-*.whl kvstore_client-*.whl")
    c = sub.add_parser("check", help="which dependencies have wheels, per CPython and architecture")
    c.add_argument("--arch", action="append", choices=ARCHES, help="default: both")
    c.add_argument("--python", action="append", help=f"default: {' '.join(PYTHONS)}")
    c.add_argument("wheels", type=Path, nargs="+", help="kvstore_server-*.whl kvstore_client-*.whl")
    args = p.parse_args()
    if args.command == "fetch":
        return fetch(args)
    args.arch = args.arch or list(ARCHES)
    args.python = args.python or list(PYTHONS)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())

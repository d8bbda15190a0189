"""The version of both distributions (kvstore-server and kvstore-client), from git.

Used by ``setup.py`` and ``clients/setup.py`` at build time (it is not part of
either package; it lives here because the client's tree is the one both
builds can reach). setuptools-scm reads the repository; this module only
says how its reading becomes a version:

- a commit tagged ``vX.Y.Z`` (and a clean tree) is the release ``X.Y.Z``;
- any other build is a development build of the release being prepared,
  ``X.Y.Z.devN+gHASH`` (``.dYYYYMMDD`` added for uncommitted changes),
  where ``N`` counts the commits since the last release tag, or since the
  first commit where a clone has no tags: either way a later commit of
  main gets a larger ``N``, so every build has its own version and a
  wheel of a later commit upgrades one of an earlier commit.

The release being prepared is the first ``## X.Y.Z — ...`` heading of
``CHANGELOG.md``: ``X.Y.Z`` while that section says "unreleased"; once it
is dated (released), the next patch release. docs/operations.md, "Cutting a
release", gives the steps. Without git (an unpacked sdist) the version is
read from the sdist's PKG-INFO by setuptools-scm as usual, or from
``SETUPTOOLS_SCM_PRETEND_VERSION`` (deploy/container/build.sh builds a copy
of the tree with the checkout's version); with neither, it is
``X.Y.Z.dev0+unknown`` and the commit "unknown".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_HEADING = re.compile(r"^## (\d+)\.(\d+)\.(\d+) — (unreleased|\d{4}-\d{2}-\d{2})\b", re.MULTILINE)

# kvstore/_version.py and kvstore_client/_version.py, written at each build (not in git).
VERSION_FILE_TEMPLATE = '''\
"""Written by the build from git (clients/build_version.py); not in the repository."""

__version__ = {version!r}
__commit__ = {scm_version.node!r}
'''


def release_being_prepared(changelog: Path) -> str:
    """``X.Y.Z`` of the first release heading of ``changelog`` (module doc)."""
    try:
        text = changelog.read_text(encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"build_version: cannot read {changelog}: {e.strerror}") from None
    found = _HEADING.search(text)
    if found is None:
        expected = "'## X.Y.Z — unreleased' or '## X.Y.Z — YYYY-MM-DD'"
        raise SystemExit(f"build_version: {changelog} has no release heading such as {expected}")
    major, minor, patch, when = found.groups()
    if when != "unreleased":
        patch = str(int(patch) + 1)
    return f"{major}.{minor}.{patch}"


def scm_settings(git_root: Path, version_file: str) -> dict[str, Any]:
    """``setup(use_scm_version=...)`` for a distribution whose repository's
    top is ``git_root`` and whose build writes ``version_file`` (relative to
    the distribution's own directory)."""
    release = release_being_prepared(git_root / "CHANGELOG.md")

    def scheme(version: Any) -> str:
        if version.exact:  # distance 0 from a tag, nothing uncommitted
            return str(version.tag)
        return f"{release}.dev{version.distance}"

    return {
        "root": str(git_root),
        "version_scheme": scheme,
        "local_scheme": "node-and-date",
        "tag_regex": r"^v(?P<version>\d+\.\d+\.\d+)$",
        "version_file": version_file,
        "version_file_template": VERSION_FILE_TEMPLATE,
        # No git at all (a tree copied without .git, say): a development build
        # of unknown commit, plainly so, rather than no build. (An sdist's
        # PKG-INFO, or SETUPTOOLS_SCM_PRETEND_VERSION, comes first.)
        "fallback_version": f"{release}.dev0+unknown",
    }

"""The client distribution's version, from git (build_version.py, shared with the
daemon's build); everything else is in pyproject.toml."""

import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from build_version import scm_settings  # noqa: E402

setup(use_scm_version=lambda: scm_settings(HERE.parent, "kvstore_client/_version.py"))

"""The packages of the kvstore-server distribution (everything else is in pyproject.toml).

The benchmark's sources stay in bench/ (the repository's layout) and install as the
package kvstore_bench: no top-level name but kvstore's own, none another project holds.
The version comes from git (clients/build_version.py, shared with the client's build).
"""

import sys
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "clients"))
from build_version import scm_settings  # noqa: E402

setup(
    # kvstore_bench.data.kv holds the KV samples and kvstore_bench.data.traces the request
    # traces (package data, no code): listed so that setuptools installs the folders as
    # part of the package.
    packages=[
        *find_packages(include=["kvstore", "kvstore.*"]),
        "kvstore_bench",
        "kvstore_bench.data.kv",
        "kvstore_bench.data.traces",
    ],
    package_dir={"kvstore_bench": "bench"},
    use_scm_version=lambda: scm_settings(HERE, "kvstore/_version.py"),
)

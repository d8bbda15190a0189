"""The packages of the kvstore-server distribution (everything else is in pyproject.toml).

The benchmark's sources stay in bench/ (the repository's layout) and install as the
package kvstore_bench: no top-level name but kvstore's own, none another project holds.
"""

from setuptools import find_packages, setup

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
)

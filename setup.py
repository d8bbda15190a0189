"""The packages of the kvstore-server distribution (everything else is in pyproject.toml).

The benchmark's sources stay in bench/ (the repository's layout) and install as the
package kvstore_bench: no top-level name but kvstore's own, none another project holds.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["kvstore", "kvstore.*"]), "kvstore_bench"],
    package_dir={"kvstore_bench": "bench"},
)

"""A real etcd (Debian's ``etcd-server``; tests/run.sh installs it) on
127.0.0.1, one member, its data in the test's temporary directory."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

NO_ETCD = "etcd is not installed (tests/run.sh installs Debian's etcd-server)"


@dataclass(frozen=True)
class EtcdServer:
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return bool(r.status == 200 and b'"true"' in r.read())
    except (OSError, urllib.error.URLError):
        return False

"""The image's HEALTHCHECK: exit 0 when the daemon's ``GET /readyz`` answers 200.

Where to ask comes from the daemon's own configuration, read as ``kvstore
serve`` reads it (KVSTORE_CONFIG's TOML, then KVSTORE_* variables): the first
TCP address of ``listen``, a wildcard host asked on loopback, over TLS when
``tls_cert`` is set (unverified: the certificate names the service, not
127.0.0.1); a daemon listening on unix sockets alone is asked on the first.
With the image's defaults that is http://127.0.0.1:8420/readyz.

Standard library and kvstore only: the image has no curl.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import sys

from kvstore.errors import ConfigError
from kvstore.server_config import load

TIMEOUT_S = 4.0
LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


class UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (http.client has none)."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=TIMEOUT_S)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def connection() -> http.client.HTTPConnection:
    cfg = load()
    if not cfg.tcp_addresses:
        return UnixConnection(cfg.unix_paths[0])
    host, port = cfg.tcp_addresses[0]
    host = LOOPBACK.get(host, host)
    if cfg.tls_cert:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return http.client.HTTPSConnection(host, port, timeout=TIMEOUT_S, context=ctx)
    return http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)


def main() -> int:
    try:
        conn = connection()
    except ConfigError as e:
        print(f"healthcheck: {e}", file=sys.stderr)
        return 1
    try:
        conn.request("GET", "/readyz")
        status = conn.getresponse().status
    except OSError as e:
        print(f"healthcheck: GET /readyz: {e}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    if status != 200:
        print(f"healthcheck: GET /readyz answered {status}, expected 200", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

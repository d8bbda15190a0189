"""SIGHUP reloads the TLS certificate and key; it never stops the daemon.

Used to be: SIGHUP killed a one-worker daemon with no log line (and a
supervisor's default action was the same), so certificates could not be
rotated without a restart.
"""

from __future__ import annotations

import signal
import socket
import ssl
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from tests.http.conftest import Daemon
from tests.http.test_daemon import _self_signed


def _presented(port: int) -> bytes:
    """The certificate a new TLS connection to the daemon is shown (DER)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(pem: Path) -> bytes:
    return x509.load_pem_x509_certificate(pem.read_bytes()).public_bytes(Encoding.DER)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sighup_reloads_the_certificate(daemon: Daemon, tmp_path: Path, workers: str) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    cert, key = _self_signed(tmp_path / "old")
    new_cert, new_key = _self_signed(tmp_path / "new")
    live_cert, live_key = tmp_path / "tls-cert.pem", tmp_path / "tls-key.pem"
    live_cert.write_bytes(cert.read_bytes())
    live_key.write_bytes(key.read_bytes())
    live_key.chmod(0o600)
    daemon.extra = ["--tls-cert", str(live_cert), "--tls-key", str(live_key), "--workers", workers]
    daemon.start()
    assert daemon.proc is not None
    for _ in range(4):  # with 2 workers, new connections may reach either
        assert _presented(daemon.port) == _der(cert)

    # A broken pair is refused and the old one stays in use.
    live_cert.write_text("not a certificate\n")
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "TLS certificate not reloaded" not in daemon.log.read_text():
        assert time.monotonic() < deadline, daemon.log.read_text()
        time.sleep(0.1)
    assert daemon.proc.poll() is None
    # Used to be: "[SSL] PEM lib (_ssl.c:3874)", naming neither the file nor the fault.
    assert f"tls_cert={str(live_cert)!r}: not a PEM certificate" in daemon.log.read_text()
    assert _presented(daemon.port) == _der(cert)

    # The rotated pair is what the next connections see, on every worker.
    live_cert.write_bytes(new_cert.read_bytes())
    live_key.write_bytes(new_key.read_bytes())
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while daemon.log.read_text().count("TLS certificate and key reloaded") < int(workers):
        assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.log.read_text()
        time.sleep(0.1)
    for _ in range(8):
        assert _presented(daemon.port) == _der(new_cert)
    assert daemon.stop(signal.SIGTERM) == 0


def test_sighup_without_tls_says_so_and_serves_on(daemon: Daemon) -> None:
    daemon.start()
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "SIGHUP: nothing to reload" not in daemon.log.read_text():
        assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.log.read_text()
        time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10):
        pass
    assert daemon.stop(signal.SIGTERM) == 0

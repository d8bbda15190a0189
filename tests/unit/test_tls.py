"""The listeners' TLS pair is checked before OpenSSL sees it, and each
fault is named with its setting and file.

Used to be: a missing file was ``[Errno 2] No such file or directory``
without its name, and a file that is not PEM, or a key of another
certificate, were both ``[SSL] PEM lib (_ssl.c:3874)`` (at start-up and in
the log of a SIGHUP that kept the old certificate)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvstore.daemon.tls import check_pair, server_context
from kvstore.errors import ConfigError
from tests.http.test_daemon import _self_signed


@pytest.fixture
def pair(tmp_path: Path) -> tuple[str, str]:
    cert, key = _self_signed(tmp_path)
    return str(cert), str(key)


def test_a_good_pair_loads(pair: tuple[str, str]) -> None:
    assert server_context(*pair).minimum_version.name == "TLSv1_2"


def refused(cert: str, key: str) -> str:
    with pytest.raises(ConfigError) as e:
        check_pair(cert, key)
    return str(e.value)


def test_a_missing_file_is_named(pair: tuple[str, str], tmp_path: Path) -> None:
    cert, key = pair
    gone = str(tmp_path / "gone.pem")
    assert refused(gone, key) == f"tls_cert={gone!r}: no such file"
    assert refused(cert, gone) == f"tls_key={gone!r}: no such file"
    assert refused(str(tmp_path), key) == f"tls_cert={str(tmp_path)!r}: a directory, not a PEM file"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_named(pair: tuple[str, str]) -> None:
    cert, key = pair
    os.chmod(key, 0)
    assert "permission denied" in refused(cert, key)


def test_a_file_that_is_not_pem_is_named(pair: tuple[str, str], tmp_path: Path) -> None:
    cert, key = pair
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    assert refused(str(junk), key).startswith(f"tls_cert={str(junk)!r}: not a PEM certificate")
    assert refused(cert, str(junk)).startswith(f"tls_key={str(junk)!r}: not a PEM private key")
    assert "(is it the certificate?)" in refused(cert, cert)  # the two settings swapped


def test_a_key_of_another_certificate_is_named(pair: tuple[str, str], tmp_path: Path) -> None:
    cert, _ = pair
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = _self_signed(other)
    assert refused(cert, str(other_key)) == (
        f"tls_key={str(other_key)!r} is not the private key of the certificate in tls_cert={cert!r}"
    )


def test_an_encrypted_key_is_named_without_its_bytes(pair: tuple[str, str], tmp_path: Path) -> None:
    cert, _ = pair
    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "encrypted.pem"
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"a passphrase"),
    )
    path.write_bytes(pem)
    said = refused(cert, str(path))
    assert said.startswith(f"tls_key={str(path)!r}: the key is encrypted")
    assert "BEGIN" not in said


def test_a_chain_file_is_accepted(pair: tuple[str, str], tmp_path: Path) -> None:
    cert, key = pair
    chain = tmp_path / "chain.pem"
    shutil.copy(cert, chain)
    with chain.open("ab") as f:  # the leaf, then an intermediate (here: another self-signed one)
        other = tmp_path / "ca"
        other.mkdir()
        f.write(_self_signed(other)[0].read_bytes())
    check_pair(str(chain), key)

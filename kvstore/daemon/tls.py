"""The listeners' TLS certificate and key: loaded at start-up and again on
SIGHUP, with an error that says which file is wrong and how.

OpenSSL's own errors name neither the file nor the fault (a missing file
is ``[Errno 2] No such file or directory``, a file that is not PEM or a key
that does not match its certificate are both ``[SSL] PEM lib``), so the
pair is checked here first, with the ``cryptography`` package the store
already uses, and only then handed to OpenSSL.
"""

from __future__ import annotations

import ssl

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

from kvstore.errors import ConfigError


def _read(setting: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"{setting}={path!r}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{setting}={path!r}: a directory, not a PEM file") from None
    except PermissionError:
        raise ConfigError(f"{setting}={path!r}: permission denied (the daemon's user cannot read it)") from None
    except OSError as e:
        raise ConfigError(f"{setting}={path!r}: cannot be read: {e.strerror or e}") from None


def check_pair(cert: str, key: str) -> None:
    """Raise :class:`ConfigError` naming the setting and the fault unless
    ``cert`` holds a PEM certificate (chain) and ``key`` the unencrypted PEM
    private key of its first certificate. Never puts key material in a message."""
    cert_pem, key_pem = _read("tls_cert", cert), _read("tls_key", key)
    try:
        certs = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise ConfigError(f"tls_cert={cert!r}: not a PEM certificate ('-----BEGIN CERTIFICATE-----')") from None
    try:
        private = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise ConfigError(
            f"tls_key={key!r}: the key is encrypted; kvstore reads unencrypted keys only (keep the file 0600)"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as e:
        hint = " (is it the certificate?)" if b"BEGIN CERTIFICATE" in key_pem else ""
        raise ConfigError(f"tls_key={key!r}: not a PEM private key{hint}: {type(e).__name__}") from None
    signing = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey
    if not isinstance(private, signing):
        raise ConfigError(f"tls_key={key!r}: a {type(private).__name__}, which cannot sign a TLS handshake")
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if private.public_key().public_bytes(*spki) != certs[0].public_key().public_bytes(*spki):
        raise ConfigError(f"tls_key={key!r} is not the private key of the certificate in tls_cert={cert!r}")


def load_pair(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    """Check the pair (:func:`check_pair`), then load it into ``ctx``."""
    check_pair(cert, key)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:  # what the checks above did not foresee
        raise ConfigError(f"tls_cert={cert!r}, tls_key={key!r}: OpenSSL refused the pair: {e}") from None


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2 and up) serving ``cert`` and ``key``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_pair(ctx, cert, key)
    return ctx

"""Keys and sealing: the master key, wrapped tenant data keys, frame sealing.

Envelope encryption: each tenant has random 256-bit data keys (one per
version); they are stored only wrapped (AES-256-GCM) by the master key, with
the tenant and version as AAD so a wrapped key cannot be moved to another
tenant. Rotating the master key rewraps data keys; data is not touched.

Frames are sealed with AES-256-GCM under a per-record key derived with HKDF
from the data key and the record's random 128-bit id; the nonce is the frame
index. format.py explains why nonces never repeat (NIST SP 800-38D §8.2.1).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from kvstore_client.wire.sealing import TAG, FrameBinding, aad, frame_nonce

from kvstore.errors import CorruptionError, MasterKeyError

KEY_BYTES = 32
_WRAP_NONCE = 12


@dataclass(frozen=True, slots=True)
class MasterKey:
    """The key-encryption key. ``key_id`` identifies it without revealing it."""

    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"MasterKey(id={self.key_id})"

    @property
    def key_id(self) -> str:
        return hmac.new(self.secret, b"kvstore master key id v1", hashlib.sha256).hexdigest()[:16]

    def wrap(self, data_key: bytes, tenant: str, version: int) -> str:
        return self.seal(data_key, _wrap_aad(tenant, version))

    def unwrap(self, wrapped: str, tenant: str, version: int) -> bytes:
        try:
            return self.open(wrapped, _wrap_aad(tenant, version))
        except MasterKeyError:
            raise MasterKeyError(
                f"cannot unwrap data key version {version} of tenant {tenant!r}: wrong master key or damaged registry"
            ) from None

    def seal(self, secret: bytes, aad: bytes) -> str:
        """``secret`` encrypted under the master key (AES-GCM, ``aad`` bound), as base64."""
        nonce = os.urandom(_WRAP_NONCE)  # few wraps per key: random nonces are far within limits
        return base64.b64encode(nonce + AESGCM(self.secret).encrypt(nonce, secret, aad)).decode()

    def open(self, sealed: str, aad: bytes) -> bytes:
        """The secret :meth:`seal` sealed with the same ``aad``."""
        try:
            raw = base64.b64decode(sealed, validate=True)
            return AESGCM(self.secret).decrypt(raw[:_WRAP_NONCE], raw[_WRAP_NONCE:], aad)
        except (InvalidTag, binascii.Error, ValueError):
            raise MasterKeyError("cannot open a secret sealed under the master key: wrong key or damaged") from None


def _wrap_aad(tenant: str, version: int) -> bytes:
    return aad(b"kvstore/v1 wrapped data key", tenant, version)


def _parse_key_text(raw: bytes, source: str) -> bytes:
    if len(raw) == KEY_BYTES:
        return raw
    text = raw.strip()
    try:
        if len(text) == 2 * KEY_BYTES:
            return bytes.fromhex(text.decode("ascii"))
        decoded = base64.b64decode(text, validate=True)
        if len(decoded) == KEY_BYTES:
            return decoded
    except (ValueError, binascii.Error, UnicodeDecodeError):
        pass
    raise MasterKeyError(
        f"master key from {source} is malformed: expected 32 raw bytes, 64 hex characters or base64 of 32 bytes"
        f" (got {len(raw)} bytes)"
    )


def load_master_key(path: str | os.PathLike[str] | None = None, env_value: str | None = None) -> MasterKey:
    """Load the master key from a file (mode 0600 or stricter; group-readable
    only as :func:`_check_key_file` allows) or a variable's value.

    A missing or malformed key is an error: there is no plaintext fallback.
    """
    if path:
        p = Path(path)
        try:
            st = p.stat()
        except OSError as e:
            raise MasterKeyError(f"master key file {str(p)!r} cannot be read: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise MasterKeyError(f"master key file {str(p)!r} is not a regular file")
        _check_key_file(p, st)
        return MasterKey(_parse_key_text(p.read_bytes(), f"file {str(p)!r}"))
    if env_value:
        return MasterKey(_parse_key_text(env_value.encode(), "KVSTORE_MASTER_KEY"))
    raise MasterKeyError(
        "no master key: set KVSTORE_MASTER_KEY_FILE (a 0600 file of 32 random bytes) or KVSTORE_MASTER_KEY"
    )


def _check_key_file(p: Path, st: os.stat_result) -> None:
    """Who else may read the master key file. Safe: nobody (0600, 0400), or
    read-only by a group this process is in, the file owned by root or by
    this process's user (0440, 0640: a Kubernetes Secret mounted with
    ``defaultMode: 0400`` under an ``fsGroup``, which Kubernetes makes 0440,
    root-owned, of the pod's fsGroup, which the daemon runs in). Refused:
    anything others may touch, anything the group may write or execute, a
    group the daemon is not in, or another user's file."""
    mode = stat.S_IMODE(st.st_mode)
    where = f"master key file {str(p)!r} has mode {mode:04o}"
    if mode & 0o007:
        raise MasterKeyError(f"{where}; others must have no access (chmod 600)")
    if mode & 0o070 == 0:
        return
    if mode & 0o070 != 0o040:
        raise MasterKeyError(f"{where}; its group may at most read it (chmod 600, or 640 for a group of readers)")
    if st.st_gid not in {os.getgid(), os.getegid(), *os.getgroups()}:
        raise MasterKeyError(
            f"{where} and group {st.st_gid}, a group this daemon is not in: anyone in it could read the key"
            " (chmod 600, or run the daemon in that group, e.g. Kubernetes' fsGroup)"
        )
    if st.st_uid not in (0, os.geteuid()):
        raise MasterKeyError(f"{where} and owner {st.st_uid}: a group-readable key must be owned by root or this user")


def new_data_key() -> bytes:
    return AESGCM.generate_key(bit_length=256)


def seal_small(data_key: bytes, key_version: int, data: bytes, aad: bytes) -> bytes:
    """``data`` sealed under ``data_key`` (a fresh random nonce): version
    (4 bytes), nonce (12), ciphertext and tag. For small metadata kept
    beside a record (a block's engine identity), never for frames."""
    nonce = os.urandom(12)
    return key_version.to_bytes(4, "big") + nonce + AESGCM(data_key).encrypt(nonce, data, aad)


def small_version(blob: bytes) -> int:
    return int.from_bytes(blob[:4], "big")


def open_small(data_key: bytes, blob: bytes, aad: bytes) -> bytes:
    try:
        return AESGCM(data_key).decrypt(blob[4:16], blob[16:], aad)
    except InvalidTag:
        raise CorruptionError("sealed metadata failed authentication (AES-GCM tag)") from None


def derive_frame_key(data_key: bytes, record_id: bytes, tenant: str, key_version: int) -> bytes:
    """The key that seals the frames of one record, and only those: what a
    client that decodes a record itself is given (never the data key)."""
    info = aad(b"kvstore/v1 frame key", tenant, key_version)  # HKDF's info, bound as additional data is
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=record_id, info=info).derive(data_key)


class RecordCipher:
    """Seals and opens the frames of one record (one derived key per record;
    nonces and additional data: kvstore_client/wire/sealing.py)."""

    __slots__ = ("_aead", "_binding", "frame_key", "record_id")

    def __init__(
        self,
        data_key: bytes,
        record_id: bytes,
        tenant: str,
        key: str,
        key_version: int,
        frame_count: int,
        logical_size: int,
    ) -> None:
        binding = FrameBinding(record_id, key_version, frame_count, logical_size, tenant, key)
        self._init(derive_frame_key(data_key, record_id, tenant, key_version), binding)

    @classmethod
    def with_frame_key(cls, frame_key: bytes, binding: FrameBinding) -> RecordCipher:
        """The cipher of a record whose frame key was derived already."""
        self = cls.__new__(cls)
        self._init(frame_key, binding)
        return self

    def _init(self, frame_key: bytes, binding: FrameBinding) -> None:
        self.frame_key = frame_key
        self._aead = AESGCM(frame_key)
        self._binding = binding
        self.record_id = binding.record_id

    def seal(self, index: int, data: bytes | bytearray | memoryview) -> bytearray:
        out = bytearray(len(data) + TAG)
        self._aead.encrypt_into(frame_nonce(index), data, self._binding.aad(index), out)
        return out

    def open_into(self, index: int, sealed: memoryview, out: bytearray | memoryview) -> None:
        try:
            self._aead.decrypt_into(frame_nonce(index), sealed, self._binding.aad(index), out)
        except InvalidTag:
            raise CorruptionError(f"frame {index} failed authentication (AES-GCM tag)") from None

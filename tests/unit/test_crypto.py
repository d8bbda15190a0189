"""crypto.py: master key loading, envelope wrapping, frame sealing and its AAD."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from kvstore.engine.crypto import MasterKey, RecordCipher, load_master_key, new_data_key
from kvstore.errors import CorruptionError, MasterKeyError


def _key_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    p = tmp_path / "master.key"
    p.write_bytes(content)
    p.chmod(mode)
    return p


@pytest.mark.parametrize("encode", [lambda k: k, lambda k: k.hex().encode() + b"\n", base64.b64encode])
def test_master_key_file_formats(tmp_path: Path, encode: object) -> None:
    secret = os.urandom(32)
    p = _key_file(tmp_path, encode(secret))  # type: ignore[operator]
    assert load_master_key(p).secret == secret


def test_master_key_from_env_value() -> None:
    secret = os.urandom(32)
    assert load_master_key(None, secret.hex()).secret == secret


def test_missing_master_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(MasterKeyError, match="no master key"):
        load_master_key(None, None)
    with pytest.raises(MasterKeyError, match="cannot be read"):
        load_master_key(tmp_path / "absent.key")


@pytest.mark.parametrize("content", [b"", b"short", os.urandom(31), b"zz" * 32, os.urandom(33)])
def test_malformed_master_key_is_an_error(tmp_path: Path, content: bytes) -> None:
    with pytest.raises(MasterKeyError, match="malformed"):
        load_master_key(_key_file(tmp_path, content))


def test_master_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MasterKeyError, match="chmod 600"):
        load_master_key(_key_file(tmp_path, os.urandom(32), 0o644))


def _other_gid() -> int:
    mine = {os.getgid(), os.getegid(), *os.getgroups()}
    return next(g for g in range(54321, 60000) if g not in mine)


@pytest.mark.parametrize("mode", [0o400, 0o600, 0o440, 0o640])
def test_a_kubernetes_secret_mount_is_accepted(tmp_path: Path, mode: int) -> None:
    # Used to be refused: a Secret with defaultMode 0400 under an fsGroup is
    # mounted 0440, root-owned, of the fsGroup the daemon runs in; chmod is
    # impossible on it, so every pod exited.
    key = os.urandom(32)
    path = _key_file(tmp_path, key, mode)
    if os.geteuid() == 0:
        os.chown(path, 0, os.getgid())  # as Kubernetes mounts it: root's, the pod's group
    link = tmp_path / "master.key.link"  # Kubernetes mounts each key as a symlink into ..data/
    link.symlink_to(path)
    assert load_master_key(link).secret == key


@pytest.mark.parametrize(
    ("mode", "group", "said"),
    [
        (0o444, "own", "others must have no access"),
        (0o604, "own", "others must have no access"),
        (0o460, "own", "its group may at most read it"),
        (0o450, "own", "its group may at most read it"),
        (0o440, "other", "a group this daemon is not in"),
    ],
)
def test_unsafe_key_file_modes_are_refused(tmp_path: Path, mode: int, group: str, said: str) -> None:
    path = _key_file(tmp_path, os.urandom(32), mode)
    if group == "other":
        if os.geteuid() != 0:
            pytest.skip("giving a file to a group this user is not in needs root")
        os.chown(path, -1, _other_gid())
    with pytest.raises(MasterKeyError, match=said):
        load_master_key(path)


def test_a_group_readable_key_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = _key_file(tmp_path, os.urandom(32), 0o440)
    os.chown(path, 54321, os.getgid())
    with pytest.raises(MasterKeyError, match="owner 54321"):
        load_master_key(path)


def test_master_key_repr_hides_the_secret() -> None:
    mk = MasterKey(b"\x01" * 32)
    assert "01" * 8 not in repr(mk) and mk.key_id in repr(mk)


def test_wrap_binds_tenant_and_version() -> None:
    mk, dk = MasterKey(os.urandom(32)), new_data_key()
    wrapped = mk.wrap(dk, "alice", 1)
    assert mk.unwrap(wrapped, "alice", 1) == dk
    for tenant, version in (("bob", 1), ("alice", 2)):
        with pytest.raises(MasterKeyError):
            mk.unwrap(wrapped, tenant, version)
    with pytest.raises(MasterKeyError):
        MasterKey(os.urandom(32)).unwrap(wrapped, "alice", 1)


def test_sealed_frames_bind_index_record_tenant_and_key() -> None:
    dk, rid = new_data_key(), os.urandom(16)
    c = RecordCipher(dk, rid, "alice", "k1", 1, 2, 200)
    f0, f1 = c.seal(0, b"a" * 100), c.seal(1, b"b" * 100)
    out = bytearray(100)
    c.open_into(0, memoryview(f0), out)
    assert out == b"a" * 100
    with pytest.raises(CorruptionError):  # frames swapped
        c.open_into(0, memoryview(f1), out)
    for other in (
        RecordCipher(dk, os.urandom(16), "alice", "k1", 1, 2, 200),  # another record
        RecordCipher(dk, rid, "bob", "k1", 1, 2, 200),  # another tenant
        RecordCipher(dk, rid, "alice", "k2", 1, 2, 200),  # another key
        RecordCipher(dk, rid, "alice", "k1", 1, 3, 200),  # truncated/extended record
    ):
        with pytest.raises(CorruptionError):
            other.open_into(0, memoryview(f0), out)


def test_nonces_differ_across_records() -> None:
    """Same plaintext, same frame index: distinct records give distinct ciphertext."""
    dk = new_data_key()
    a = RecordCipher(dk, os.urandom(16), "t", "k", 1, 1, 10).seal(0, b"x" * 10)
    b = RecordCipher(dk, os.urandom(16), "t", "k", 1, 1, 10).seal(0, b"x" * 10)
    assert a != b

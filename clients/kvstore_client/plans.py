"""Read plans: read direct blocks straight from the daemon's segment files.

Over the daemon's unix socket (``unix:PATH`` endpoints), ``POST
/v1/read-plan`` answers where each block's bytes are (a file, an offset, a
size, each frame's xxh3-64) and passes the files' descriptors with the
answer (SCM_RIGHTS), once per file per connection, so this process needs no
permission on the data directory. Blocks are then read with ``os.preadv``
into host memory, or with kvikio (GPUDirect Storage) into GPU memory when the
destination is a CUDA buffer and kvikio is installed (``pip install
'kvstore-client[gds]'``). Host reads are checked frame by frame against the
daemon's checksums, as the daemon checks them: a mismatch raises, never
returns bytes. (GPU reads are not: the bytes never pass through the CPU.)

The HTTP exchange is written by hand on a blocking socket because the
descriptors arrive as ancillary data, which HTTP client libraries drop.
Blocks a plan cannot give (sealed, in the object tier only) are read with
GET by the caller.

A plan may carry paths instead (``{"paths": true}``, a daemon with
``plan_paths`` on, over any endpoint): for a host that mounts the daemon's
data directory at the same path (NFS, Lustre, WEKA, VAST). A path block is
read by opening its file read-only for the read (kvikio opens the path
itself), with the same checks; a file compacted away after the lease fails
to open or fails the checksums, never returns other bytes.
"""

from __future__ import annotations

import array
import json
import os
import socket
import threading
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from kvstore_client.errors import CorruptBlock, KVStoreClientError, ProtocolError, ServerError, UnavailableError

if TYPE_CHECKING:
    from kvstore_client.record import RecordMeta

MAX_FDS = 1024  # descriptors one answer may carry (the daemon's max_batch_keys by default)
RECV = 1 << 16


@dataclass(frozen=True, slots=True)
class PlannedBlock:
    key: str
    #: this connection's descriptor of the segment file (owned by the
    #: connection); -1 for a block given by path
    fd: int
    offset: int
    size: int
    frame_size: int
    checksums: tuple[int, ...]
    #: a sealed block: its stored frames start at ``offset``; this opens them
    record: RecordMeta | None = None
    #: the segment file's absolute path on a shared filesystem (a plan with
    #: paths), opened for each read instead of ``fd``
    path: str | None = None

    @property
    def stored_len(self) -> int:
        """Bytes to read from the file: the stored frames (sealed) or the block."""
        return self.size if self.record is None else self.record.stored_len


@dataclass(slots=True)
class Plan:
    path: str  # the daemon's socket ("" for a plan from an http(s) endpoint)
    lease: str
    expires_in_s: float
    blocks: dict[str, PlannedBlock] = field(default_factory=dict)
    #: keys the plan does not give, with (status, code): 404 is a miss, others are read with GET
    others: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: the http(s) endpoint that gave a plan with paths (released there); None: the unix socket ``path``
    endpoint: str | None = None


def parse_plan(doc: Any, path: str, fds: dict[int, int], endpoint: str | None = None) -> Plan:
    """A plan from the daemon's answer; ``fds``: this connection's file ids
    to descriptors (empty for a plan with paths). Raises ProtocolError on a
    malformed answer."""
    try:
        lease = doc["lease"]
        if not isinstance(lease, str) or not lease.isalnum():
            raise ValueError(f"lease {lease!r}")
        plan = Plan(path, lease, float(doc["expires_in_s"]), endpoint=endpoint)
        for b in doc["blocks"]:
            key = str(b["key"])
            if b["status"] != 200:
                plan.others[key] = (int(b["status"]), str(b.get("error", {}).get("code", "")))
                continue
            record = None
            if "record" in b:  # sealed: opened here, if the decode extra is installed
                try:
                    from kvstore_client.record import meta_of
                except ImportError:
                    plan.others[key] = (409, "decode_unavailable")
                    continue
                record = meta_of(b["record"], key)
            file_path = b.get("path")
            if file_path is not None and (not isinstance(file_path, str) or not os.path.isabs(file_path)):
                raise ValueError(f"block {key}: path {file_path!r} is not absolute")
            plan.blocks[key] = PlannedBlock(
                key,
                -1 if file_path is not None else fds[b["file"]],
                int(b["offset"]),
                int(b["size"]),
                int(b["frame_size"]),
                tuple(int(c, 16) for c in b["xxh3"]),
                record,
                file_path,
            )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(f"malformed read plan: {type(e).__name__}: {e}") from None
    return plan


class PlanConnection:
    """One connection to a daemon's unix socket, with the descriptors it was
    given. Thread-safe: calls are serialized on the connection."""

    def __init__(self, path: str, token: str | None, timeout: float = 5.0) -> None:
        self.path = path
        self._token = token
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._fds: dict[int, int] = {}  # file id on this connection -> descriptor
        self._to_close: list[int] = []  # of files the daemon let go, once no plan is outstanding
        self._outstanding: set[str] = set()  # leases of plans not released yet
        self._lock = threading.Lock()

    # -- the plan ---------------------------------------------------------------

    def plan(self, keys: list[str], lease_s: float | None = None, paths: bool = False) -> Plan:
        """A plan of ``keys``; ``paths``: with the files' paths (the daemon's
        ``plan_paths``), not descriptors."""
        body: dict[str, Any] = {"keys": keys}
        if lease_s is not None:
            body["lease_s"] = lease_s
        if paths:
            body["paths"] = True
        with self._lock:
            status, doc, fds = self._exchange("POST", "/v1/read-plan", json.dumps(body).encode())
            if status != 200:
                for fd in fds:
                    os.close(fd)
                _raise(status, doc, "read plan refused")
            files = doc["files"]
            if len(files) != len(fds):
                for fd in fds:
                    os.close(fd)
                self._reset()
                raise UnavailableError(f"read plan named {len(files)} new files but {len(fds)} descriptors came")
            self._fds.update(zip(files, fds, strict=True))
            for fid in doc.get("closed", ()):
                if fid in self._fds:
                    self._to_close.append(self._fds.pop(fid))
            plan = parse_plan(doc, self.path, self._fds)
            self._outstanding.add(plan.lease)
            return plan

    def release(self, lease: str) -> None:
        """Let the daemon compact and drop the plan's segments again."""
        with self._lock:
            self._outstanding.discard(lease)
            if not self._outstanding:  # no block of an earlier plan can be read from these any more
                for fd in self._to_close:
                    os.close(fd)
                self._to_close.clear()
            status, doc, fds = self._exchange("DELETE", f"/v1/read-plan/{lease}", None)
        for fd in fds:
            os.close(fd)
        if status != 204:
            _raise(status, doc, "releasing the read plan")

    # -- write plans (write_plans.py moves the bytes) ----------------------------

    def plan_writes(
        self, blocks: list[dict[str, Any]], lease_s: float | None = None, encode: str | None = None
    ) -> tuple[Any, list[int]]:
        """Ask for room for ``blocks`` (``{"key", "size", "meta"?}``): the
        answer and the files' descriptors (the caller closes them), in the
        order of its ``files``. ``encode="client"``: a sealed tenant's
        records are sealed here (each block then carries ``record``)."""
        body: dict[str, Any] = {"blocks": blocks}
        if lease_s is not None:
            body["lease_s"] = lease_s
        if encode is not None:
            body["encode"] = encode
        with self._lock:
            status, doc, fds = self._exchange("POST", "/v1/write-plan", json.dumps(body).encode())
        if status != 200:
            for fd in fds:
                os.close(fd)
            _raise(status, doc, "write plan refused")
        if not isinstance(doc, dict) or len(doc.get("files", ())) != len(fds):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"write plan named {len(doc.get('files', ()))} files but {len(fds)} descriptors came")
        return doc, fds

    def commit_writes(self, plan: str, blocks: list[dict[str, Any]]) -> Any:
        """Commit plan ``plan`` with ``blocks`` (``{"key", "xxh3": [hex]}``)."""
        with self._lock:
            status, doc, fds = self._exchange("POST", f"/v1/write-plan/{plan}", json.dumps({"blocks": blocks}).encode())
        for fd in fds:
            os.close(fd)
        if status != 200:
            _raise(status, doc, "write plan commit refused")
        return doc

    def abandon_writes(self, plan: str) -> None:
        with self._lock:
            status, doc, fds = self._exchange("DELETE", f"/v1/write-plan/{plan}", None)
        for fd in fds:
            os.close(fd)
        if status not in (204, 404):
            _raise(status, doc, "abandoning the write plan")

    @staticmethod
    def read_into(block: PlannedBlock, buf: Any, pool: Executor | None = None) -> int:
        """Read ``block`` into ``buf`` (host memory: checked; a CUDA buffer:
        through kvikio); returns its size. A sealed block's frames are opened
        here (on ``pool``'s threads when given) into host memory only. A
        block given by path opens its file for the read (OSError if it
        cannot: gone, no permission, not mounted here)."""
        if hasattr(buf, "__cuda_array_interface__"):
            if block.record is not None:
                raise KVStoreClientError(
                    f"block {block.key} is sealed: it is decoded on the CPU; read it into host memory",
                    code="sealed_to_gpu",
                )
            return _read_gpu(block, buf)
        mv = memoryview(buf).cast("B")
        if mv.nbytes < block.size:
            raise KVStoreClientError(f"block {block.key} is {block.size} bytes; the buffer holds {mv.nbytes}")
        if block.path is None:
            return _read_host(block, block.fd, mv[: block.size], pool)
        fd = os.open(block.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _read_host(block, fd, mv[: block.size], pool)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._reset()

    # -- HTTP on a unix socket, descriptors included ---------------------------

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for fd in [*self._fds.values(), *self._to_close]:
            os.close(fd)
        self._fds.clear()
        self._to_close.clear()
        self._outstanding.clear()

    def _exchange(self, method: str, path: str, body: bytes | None) -> tuple[int, Any, list[int]]:
        for attempt in (0, 1):  # a kept-alive connection the daemon closed: once more on a new one
            fresh = self._sock is None
            try:
                if self._sock is None:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(self._timeout)
                    s.connect(self.path)
                    self._sock = s
                return self._roundtrip(self._sock, method, path, body)
            except OSError as e:
                self._reset()
                if fresh or attempt:
                    raise UnavailableError(f"{self.path}: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    def _roundtrip(self, s: socket.socket, method: str, path: str, body: bytes | None) -> tuple[int, Any, list[int]]:
        head = [f"{method} {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body or b'')}"]
        if body is not None:
            head.append("Content-Type: application/json")
        if self._token:
            head.append(f"Authorization: Bearer {self._token}")
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
        buf = bytearray()
        fds: list[int] = []
        length = -1
        start = 0
        status = 0
        while True:
            data, anc, flags, _ = s.recvmsg(RECV, socket.CMSG_SPACE(MAX_FDS * 4))
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(raw[: len(raw) - len(raw) % got.itemsize])
                    fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                for fd in fds:
                    os.close(fd)
                raise OSError("descriptors were cut off (MSG_CTRUNC)")
            if not data:
                for fd in fds:
                    os.close(fd)
                raise ConnectionResetError("the daemon closed the connection mid-answer")
            buf += data
            if length < 0 and (end := buf.find(b"\r\n\r\n")) >= 0:
                lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
                status = int(lines[0].split()[1])
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
                length = int(headers.get("content-length", "0"))
                start = end + 4
            if length >= 0 and len(buf) - start >= length:
                text = bytes(buf[start : start + length])
                doc = json.loads(text) if text else None
                return status, doc, fds


def _raise(status: int, doc: Any, what: str) -> None:
    err = doc.get("error", {}) if isinstance(doc, dict) else {}
    raise ServerError(
        str(err.get("message", f"{what} ({status})")),
        status=status,
        code=str(err.get("code", "server_error")),
        retryable=status >= 500,
    )


def _read_host(block: PlannedBlock, fd: int, out: memoryview, pool: Executor | None) -> int:
    """``block`` from the open file ``fd`` into ``out`` (its size), checked."""
    if block.record is not None:
        return _read_sealed(block, fd, block.record, out, pool)
    _pread_all(block, fd, out)
    fs = block.frame_size
    for i, want in enumerate(block.checksums):
        if xxhash.xxh3_64_intdigest(out[i * fs : min((i + 1) * fs, block.size)]) != want:
            raise CorruptBlock(f"block {block.key}: frame {i} fails its checksum")
    return block.size


def _pread_all(block: PlannedBlock, fd: int, mv: memoryview) -> None:
    n = 0
    while n < len(mv):
        got = os.preadv(fd, [mv[n:]], block.offset + n)
        if got <= 0:
            raise CorruptBlock(f"block {block.key}: its segment file ends {len(mv) - n} bytes short")
        n += got


def _read_sealed(block: PlannedBlock, fd: int, meta: RecordMeta, out: memoryview, pool: Executor | None) -> int:
    """The stored frames of a sealed block, read in one preadv and opened
    (checksum, GCM tag, codec) into ``out``, frames in parallel on ``pool``."""
    from kvstore_client.record import RecordOpener

    stored = bytearray(meta.stored_len)
    _pread_all(block, fd, memoryview(stored))
    opener = RecordOpener(meta, out)
    parts, at = [], 0
    for j, f in enumerate(meta.frames):
        parts.append((j, memoryview(stored)[at : at + f.length]))
        at += f.length
    if pool is None or len(parts) == 1:
        for j, part in parts:
            opener.place(j, part)
    else:
        futs = [pool.submit(opener.place, j, part) for j, part in parts]
        wait(futs)  # every thread is done with ``out`` before an error is raised
        for fut in futs:
            fut.result()
    return block.size


def _read_gpu(block: PlannedBlock, buf: Any) -> int:
    try:
        import kvikio  # type: ignore[import-not-found]
    except ImportError:
        raise KVStoreClientError(
            "a CUDA buffer needs kvikio (pip install 'kvstore-client[gds]')", code="gds_unavailable"
        ) from None
    # kvikio opens by path: a plan's path on the shared filesystem, or the
    # descriptor's own path, which reaches the same file, unlinked or not,
    # without any permission on the data directory.
    with kvikio.CuFile(block.path or f"/proc/self/fd/{block.fd}", "r") as f:
        n = int(f.pread(buf, block.size, block.offset).get())
    if n != block.size:
        raise CorruptBlock(f"block {block.key}: read {n} of {block.size} bytes into GPU memory")
    return n

"""Blocking HTTP clients for the fuzz suite (hypothesis drives sync tests):
one that stays on a chosen kind of worker, and one that sends raw bytes."""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket

from tests.http.rawhttp import Reply as Answer


class Worker:
    """Keep-alive connections to one kind of worker of a daemon ("single",
    "writer" or "reader"), reopened (on the same kind) whenever the server
    closes one. Either worker may accept a new connection; /healthz names the role."""

    def __init__(self, port: int, role: str, timeout: float = 30) -> None:
        self.port = port
        self.role = role
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _open(self) -> http.client.HTTPConnection:
        for _ in range(200):
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            conn.request("GET", "/healthz")
            r = conn.getresponse()
            role = json.loads(r.read())["role"]
            if role == self.role:
                return conn
            conn.close()
        raise AssertionError(f"no connection reached a {self.role} worker")

    def request(self, method: str, target: str, headers: dict[str, str] | None = None, body: bytes = b"") -> Answer:
        send = body if body or method in ("PUT", "POST") else None
        for attempt in (1, 2):
            if self._conn is None:
                self._conn = self._open()
            conn = self._conn
            try:
                conn.request(method, target, body=send, headers=headers or {})
                r = conn.getresponse()
                data = r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError):
                # A keep-alive connection the server closed (idle timeout) just as
                # the request went out: nothing was read; send it again, once.
                self.close()
                if attempt == 2:
                    raise
                continue
            except BaseException:
                self.close()  # the connection is in an unknown state
                raise
            if r.will_close:
                self.close()
            return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def exchange(
    port: int, raw: bytes, half_close: bool = False, timeout: float = 15, patience: float = 0.3
) -> tuple[Answer | None, bool]:
    """Send ``raw`` on a fresh connection and read the first final answer
    (interim 1xx answers skipped; its status line must be HTTP/1.0 or 1.1). Unless
    ``half_close``, the client waits ``patience`` seconds for an answer before
    it half-closes (so an incomplete request does not wait for the server's
    timeouts). Returns (the answer, or None if the server closed without
    one; whether the server answered or closed within ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(OSError):  # the server may close before it has read everything
            sock.sendall(raw)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            else:
                readable, _, _ = select.select([sock], [], [], patience)
                if not readable:
                    sock.shutdown(socket.SHUT_WR)
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return None, True
                    buf += chunk
                head, _, rest = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                status = int(lines[0].split()[1])
                if not 100 <= status < 200:
                    break
                buf = rest  # an interim answer (100 Continue): the final one follows
            if not _status_line(lines[0]):
                raise AssertionError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            no_body = raw.startswith(b"HEAD ") or status in (204, 304)
            length = 0 if no_body else int(headers.get("content-length", "0"))
            while len(rest) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
            return Answer(status, headers, rest[:length]), True
        except TimeoutError:
            return None, False
        except ConnectionResetError:
            return None, True


def _status_line(line: str) -> bool:
    """Whether ``line`` is an HTTP/1.0 or HTTP/1.1 status line: the server
    never answers in a version it does not speak (it answered HTTP/2.0 and
    HTTP/0.9 requests in their own version)."""
    version, _, rest = line.partition(" ")
    return version in ("HTTP/1.0", "HTTP/1.1") and rest[:3].isdigit()

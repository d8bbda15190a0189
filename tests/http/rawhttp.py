"""A minimal HTTP/1.1 client over a raw socket, for requests no library sends
as written (percent-encoded paths kept as they are, broken headers, stalled
bodies) and for keeping a request on one chosen connection (one worker)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    @property
    def code(self) -> str | None:
        """The machine-readable error code of a JSON error body, if any."""
        try:
            doc = json.loads(self.body)
        except ValueError:
            return None
        err = doc.get("error") if isinstance(doc, dict) else None
        return err.get("code") if isinstance(err, dict) else None

    def json(self) -> Any:
        return json.loads(self.body)


class Conn:
    """One keep-alive connection. ``request`` sends and reads one answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Conn:
        r, w = await asyncio.open_connection(host, port)
        return cls(r, w)

    async def send(self, raw: bytes) -> None:
        self.writer.write(raw)
        await self.writer.drain()

    async def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        timeout: float = 10,
    ) -> Reply:
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body or method in ("PUT", "POST"):
            lines.append(f"Content-Length: {len(body)}")
        await self.send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        return await self.read_reply(timeout, head=method == "HEAD")

    async def read_reply(self, timeout: float = 10, head: bool = False) -> Reply:
        async with asyncio.timeout(timeout):
            status_line = await self.reader.readuntil(b"\r\n")
            status = int(status_line.split()[1])
            headers: dict[str, str] = {}
            while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            body = b""
            if not head and status not in (204, 304) and "content-length" in headers:
                body = await self.reader.readexactly(int(headers["content-length"]))
            elif not head and headers.get("transfer-encoding") == "chunked":
                while True:
                    size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                    chunk = await self.reader.readexactly(size + 2)
                    if size == 0:
                        break
                    body += chunk[:-2]
        return Reply(status, headers, body)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


async def worker_connections(host: str, port: int, attempts: int = 200) -> dict[str, Conn]:
    """One keep-alive connection to each kind of worker of a multi-worker
    daemon (they share the listening socket: new connections reach either; /healthz names the role)."""
    found: dict[str, Conn] = {}
    for _ in range(attempts):
        conn = await Conn.open(host, port)
        role = (await conn.request("GET", "/healthz")).json()["role"]
        if role in found:
            await conn.close()
        else:
            found[role] = conn
        if {"writer", "reader"} <= set(found):
            return found
    for conn in found.values():
        await conn.close()
    raise AssertionError(f"only reached {sorted(found)} in {attempts} connections")

"""The daemon's admin API over HTTP or HTTPS: one request per call, JSON in
and out, on the standard library alone (the command adds no dependency).

Every failure becomes one of kvstore/admin/errors.py's, with a message that
names it: an error answer by its status, the daemon's code and message (a
401 as the admin token refused), a connection that fails by the URL it was
for. The token is sent, never shown.
"""

from __future__ import annotations

import copy
import http.client
import json
import socket
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.admin.errors import Refused, Unreachable, UsageError

USER_AGENT = "kvstore-admin"
MAX_ANSWER_BYTES = 64 << 20  # a tenant list of a very large node is a few MB; a bound for a wrong URL's answer


@dataclass(frozen=True, slots=True)
class Answer:
    """A successful answer: its status, its JSON document (None without a
    body, as a 204) and its headers (names in any case)."""

    status: int
    doc: Any
    headers: Mapping[str, str]

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == lowered), None)


class Client:
    """Admin calls to the daemon at ``url`` (``http://HOST:PORT`` or
    ``https://HOST:PORT``, verified against the system's certificate
    authorities) with the admin ``token``; ``timeout_s`` bounds each call's
    connection and each wait for bytes of its answer (None: no bound)."""

    def __init__(self, url: str, token: str, timeout_s: float | None = 30.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(
                f"the URL {url!r} is not one of the daemon's: expected http://HOST:PORT or https://HOST:PORT"
            )
        if parts.query or parts.fragment:
            raise UsageError(f"the URL {url!r} has a query or a fragment: expected http://HOST:PORT")
        try:
            self._port = parts.port
        except ValueError:
            raise UsageError(f"the URL {url!r} has a bad port: expected http://HOST:PORT") from None
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._base = parts.path.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def get(self, path: str, query: Mapping[str, str] | None = None) -> Answer:
        return self.call("GET", path, query=query)

    def bounded(self, timeout_s: float | None) -> Client:
        """This client with another bound on each call (None: none)."""
        other = copy.copy(self)
        other.timeout_s = timeout_s
        return other

    def call(self, method: str, path: str, doc: Any = None, query: Mapping[str, str] | None = None) -> Answer:
        """``method`` on ``path`` (quoted by the caller) with the JSON
        ``doc`` as its body. Raises :class:`Refused` for an error answer
        and :class:`Unreachable` when no answer of the API's comes back."""
        timeout = self.timeout_s
        target = self._base + path + ("?" + urllib.parse.urlencode(query) if query else "")
        body = None if doc is None else json.dumps(doc).encode()
        headers = {"Authorization": f"Bearer {self.token}", "User-Agent": USER_AGENT, "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn = self._connection(timeout)
        try:
            try:
                conn.request(method, target, body=body, headers=headers)
                response = conn.getresponse()
                raw = response.read(MAX_ANSWER_BYTES + 1)
            except TimeoutError:
                raise Unreachable(f"no answer from {self.url} within {timeout or 0:g} s") from None
            except ssl.SSLError as e:
                raise Unreachable(f"cannot reach the daemon at {self.url}: TLS: {e.reason or e}") from None
            except ConnectionRefusedError:
                raise Unreachable(f"cannot reach the daemon at {self.url}: connection refused") from None
            except socket.gaierror as e:
                raise Unreachable(f"cannot reach the daemon at {self.url}: unknown host ({e.strerror})") from None
            except http.client.HTTPException as e:
                raise Unreachable(f"the answer of {self.url} was cut off or not HTTP ({type(e).__name__})") from None
            except OSError as e:
                raise Unreachable(f"cannot reach the daemon at {self.url}: {e.strerror or e}") from None
        finally:
            conn.close()
        if len(raw) > MAX_ANSWER_BYTES:
            raise Unreachable(f"{method} {path}: the answer of {self.url} is over {MAX_ANSWER_BYTES} bytes")
        answer_headers = dict(response.getheaders())
        if response.status >= 400:
            raise self._refusal(method, path, response.status, raw)
        if not 200 <= response.status < 300:
            where = answer_headers.get("Location", "")
            raise Unreachable(
                f"{method} {path}: {self.url} answered {response.status} {response.reason}"
                + (f" (to {where})" if where else "")
                + ": give the daemon's own URL"
            )
        if not raw:
            return Answer(response.status, None, answer_headers)
        try:
            return Answer(response.status, json.loads(raw), answer_headers)
        except ValueError:
            raise Unreachable(f"{method} {path}: {self.url} answered with no JSON (is it a kvstore daemon?)") from None

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _refusal(self, method: str, path: str, status: int, raw: bytes) -> Refused:
        """The daemon's error answer as one line: its code and message (the
        API's ``{"error": {"code", "message"}}``), or its status alone."""
        code, message = "", ""
        try:
            error = json.loads(raw).get("error")
            if isinstance(error, dict):
                code, message = str(error.get("code", "")), str(error.get("message", ""))
        except (ValueError, AttributeError):
            pass
        said = f"{code}: {message}" if code else (message or http.client.responses.get(status, "error"))
        if status == 401:
            return Refused(f"the admin token was refused by {self.url} ({status} {said})", status, code)
        return Refused(f"{method} {path}: {status} {said}", status, code)

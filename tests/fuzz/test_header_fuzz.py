"""Header values on every route, and HTTP versions, over raw sockets, on one
worker and on ``--workers 2`` (issue 24: what found items 4-6).

Every operation of docs/openapi.yaml (the event stream included: its head is
read, then the connection dropped) is sent with its usual credential and
body, plus drawn values of ``Expect``, ``Kvstore-Block-Meta`` (valid
identities, nesting thousands deep, any JSON, garbage), ``Last-Event-ID``,
``Range`` and ``If-None-Match``, in HTTP/1.1, 1.0, 2.0, 9.9 or 0.9. Whatever
is sent:

- a well-formed request is answered, in HTTP/1.0 or 1.1, never with a 5xx
  but ``503 overloaded`` and ``505`` for a version other than 1.0 and 1.1
  (nothing is served in another version);
- an error is the JSON error body, with a status the description gives the
  operation (or any request);
- an ``Expect`` other than ``100-continue`` is never ignored (a 4xx);
- a ``Last-Event-ID`` that is not a sequence number is ``400``;
- no header value is echoed in the body, no secret either;

then :meth:`Target.check` (no ERROR line or traceback in the log, nothing
counted as internal, the canaries intact on every worker).
"""

from __future__ import annotations

import base64
import json
import re
import string
from dataclasses import dataclass, field
from urllib.parse import quote

from hypothesis import strategies as st

from tests.fuzz.client import Answer, exchange
from tests.fuzz.conftest import SETTINGS, Target, fuzz
from tests.fuzz.test_api_fuzz import ANY_JSON, SPEC, body_for
from tests.http.conftest import ADMIN
from tests.http.openapi import Operation

REQUEST_TIMEOUT_S = float(SETTINGS["request_timeout_s"])
KEEPALIVE_TIMEOUT_S = float(SETTINGS["keepalive_timeout_s"])
OPERATIONS = SPEC.operations()
VERSIONS = ["HTTP/1.1"] * 12 + ["HTTP/1.0", "HTTP/1.0", "HTTP/2.0", "HTTP/9.9", "HTTP/0.9", ""]
SPOKEN = ("HTTP/1.1", "HTTP/1.0")
LAST_EVENT_ID = re.compile(r"[0-9]{0,18}")
PRINTABLE = st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " ", min_size=1, max_size=60)
# Path parameters: valid, and never a canary's tenant where the call changes it.
PATH_VALUES = {
    "token_id": "0123456789abcdef",
    "lease": "0" * 32,
    "plan": "0" * 32,
    "access_key_id": "KVS" + "A" * 17,
    "node_id": "node-9",
}


@dataclass
class Case:
    op: Operation
    target: str
    version: str
    headers: dict[str, str]
    body: bytes
    drawn: dict[str, str] = field(default_factory=dict)  # the fuzzed header values

    def raw(self) -> bytes:
        if not self.version:  # HTTP/0.9's request: a method and a path, nothing else
            return f"{self.op.method} {self.target}\r\n\r\n".encode()
        lines = [f"{self.op.method} {self.target} {self.version}", "Host: 127.0.0.1"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()]
        if self.body or self.op.method in ("PUT", "POST", "PATCH"):
            lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


META = st.one_of(
    # valid identities
    st.fixed_dictionaries(
        {"block_hash": st.integers(-(1 << 63), (1 << 64) - 1)},
        optional={
            "token_ids": st.lists(st.integers(0, (1 << 32) - 1), max_size=8),
            "extra_keys": ANY_JSON,
            "lora_name": st.none() | st.text(max_size=10),
        },
    ).map(lambda d: _b64(json.dumps(d).encode())),
    # nested thousands deep: the whole document, or extra_keys
    st.integers(40, 6000).map(lambda n: _b64(b"[" * n)),
    st.integers(20, 2900).map(lambda n: _b64(b'{"block_hash": 1, "extra_keys": ' + b"[" * n + b"]" * n + b"}")),
    st.integers(20, 3000).map(lambda n: _b64(b'{"block_hash": ' + b"[" * n + b"]" * n + b"}")),
    ANY_JSON.map(lambda v: _b64(json.dumps(v).encode())),
    PRINTABLE,
)
RANGE = st.one_of(
    st.sampled_from(["bytes=0-0", "bytes=-10", "bytes=5-", "bytes=9-3", "bytes=0-1,4-5", "bytes=0-4095,4096-"]),
    st.sampled_from(["bytes=99999999-", "bytes=-0", "bytes=0-", "items=0-1", "bytes=" + "0-1," * 20]),
    PRINTABLE,
)


def _optional(draw: st.DrawFn, likely: bool, values: st.SearchStrategy[str]) -> str | None:
    """A value, drawn mostly for the headers an operation takes (``likely``)."""
    return draw(values) if draw(st.integers(0, 9)) < (7 if likely else 1) else None


@st.composite
def cases(draw: st.DrawFn, target: Target) -> Case:
    op = draw(st.sampled_from(OPERATIONS))
    path = op.path
    for name in re.findall(r"\{(\w+)\}", op.path):
        if name == "key":
            keys = [k for blocks in target.canaries.values() for k in blocks] if op.method in ("GET", "HEAD") else []
            value = draw(st.sampled_from([*keys, "fz.h"]))
        elif name == "name":
            value = "fz-none" if op.method in ("DELETE", "PATCH") else draw(st.sampled_from(["canary-a", "fz-none"]))
        else:
            value = PATH_VALUES[name]
        path = path.replace("{" + name + "}", quote(value, safe=""))
    token = ADMIN if op.path.startswith("/v1/admin/") else target.tokens["canary-a"]
    headers: dict[str, str] = {}
    if op.path.startswith("/v1/") and draw(st.integers(0, 9)) < 8:
        headers["Authorization"] = f"Bearer {token}"
    content_type, body = draw(body_for(op)) if op.method in ("PUT", "POST", "PATCH") else (None, b"")
    if content_type is not None:
        headers["Content-Type"] = content_type
    drawn: dict[str, str] = {}
    secrets = [f"Bearer {t}" for t in (*target.tokens.values(), ADMIN)]
    for name, likely, values in (
        ("Expect", False, st.sampled_from(["100-continue", "100-Continue", "100-continue, x", "x"]) | PRINTABLE),
        ("Expect", False, st.sampled_from(secrets)),
        ("Kvstore-Block-Meta", op.method == "PUT" and op.path == "/v1/blocks/{key}", META),
        ("Last-Event-ID", op.path == "/v1/events", st.from_regex(r"[0-9]{1,12}", fullmatch=True) | PRINTABLE),
        ("Range", "Range" in _header_params(op), RANGE),
        ("If-None-Match", "If-None-Match" in _header_params(op), st.sampled_from(['"x"', "*", 'W/"y"']) | PRINTABLE),
    ):
        value = _optional(draw, likely, values)
        if value is not None and name not in drawn:
            drawn[name] = headers[name] = value
    return Case(op, path, draw(st.sampled_from(VERSIONS)), headers, body, drawn)


def _header_params(op: Operation) -> set[str]:
    item = SPEC.doc["paths"][op.path]
    params = [SPEC.resolve(p) for p in (*item.get("parameters", ()), *op.doc.get("parameters", ()))]
    return {p["name"] for p in params if p["in"] == "header"}


def check(target: Target, case: Case, answer: Answer | None, in_time: bool) -> None:
    where = f"{case.version or 'HTTP/0.9'} {case.op.method} {case.target[:80]} {sorted(case.drawn)}"
    assert in_time and answer is not None, f"no answer: {where}"
    where += f" -> {answer.status} {answer.code}"
    assert answer.status < 500 or answer.code == "overloaded" or answer.status == 505, where
    head = case.op.method == "HEAD"  # no body read
    if case.version not in SPOKEN:
        assert answer.status == 505 and (head or answer.code == "http_version_not_supported"), where
        return
    if answer.status >= 400 and not head:
        assert answer.content_type.startswith("application/json"), where
        assert answer.code and json.loads(answer.body)["error"]["message"], where
    found = SPEC.problems(case.op.method, case.op.path, answer.status, answer.content_type, answer.body)
    assert not found, (where, found)
    expect = case.drawn.get("Expect")
    if expect is not None and expect.strip(" \t").lower() != "100-continue":
        assert answer.status >= 400, f"an Expect was ignored: {where}"
    last = case.drawn.get("Last-Event-ID", "").strip(" \t")
    if case.op.path == "/v1/events" and "Authorization" in case.headers and not LAST_EVENT_ID.fullmatch(last):
        assert (answer.status, answer.code) in ((400, "invalid_input"), (417, "expectation_failed")), where
    text = answer.body.decode("latin-1")
    for name, value in case.drawn.items():
        value = value.strip(" \t")
        assert len(value) < 8 or value not in text, f"{name} echoed: {where}"
    for secret in target.secrets:
        assert secret not in text, f"a secret was echoed: {where}"


def test_header_values_and_versions_on_every_route(target: Target) -> None:
    def one(case: Case) -> None:
        answer, in_time = exchange(target.port, case.raw(), timeout=REQUEST_TIMEOUT_S + KEEPALIVE_TIMEOUT_S + 10)
        check(target, case, answer, in_time)

    fuzz(one, examples=300, case=cases(target))
    target.check()

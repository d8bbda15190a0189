"""Property-based API fuzzing driven by docs/openapi.yaml, on one worker and
on both kinds of worker of ``--workers 2``.

Requests are drawn from the description: an operation, its path parameters
(valid by their schema, or hostile: any text, percent-encoded), a token (each
tenant's, the admin's, none, garbage, non-ASCII), query parameters (valid by
their schema, any text, or text that int() or float() would take but the
schema's type does not: "+5", " 5", "5_0", "1e3", "nan", Unicode digits; a
parameter given twice), header parameters (valid by their schema, or any
text) and an ``Expect``, and a body (valid by its schema, or any JSON, or any
bytes; for batch puts a valid stream or a mutated one; assorted charsets).
Every answer must be one the description gives for that operation (status,
content type, JSON schema), never a 5xx but the documented retryable ones,
and never echo a header value. A query parameter that is not of its type is
400. Then :meth:`Target.check`.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from hypothesis import strategies as st
from kvstore_client.wire import batchframe

from tests.fuzz.conftest import Target, fuzz
from tests.http.conftest import ADMIN
from tests.http.openapi import Operation, Spec

SPEC = Spec.load()
# The event stream does not end: a fuzzed call that is answered 200 would never
# return (tests/http/test_events.py checks it, its bad input included).
STREAMS = {("GET", "/v1/events")}
OPERATIONS = [op for op in SPEC.operations() if (op.method, op.path) not in STREAMS]
RETRYABLE_5XX = {503: {"overloaded", "not_ready", "io_error"}, 507: {"storage_full"}}
# Never aimed at the canaries the final check reads back: deleting them, or
# changing their tenant (a quota could evict them).
DESTRUCTIVE = ("DELETE", "PATCH")


@dataclass
class Call:
    op: Operation
    role: str
    target: str
    headers: dict[str, str]
    body: bytes
    mistyped: bool = False  # a query parameter's value is not of its schema's type


def from_schema(schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values valid under the JSON Schema subset docs/openapi.yaml uses for
    request bodies (object, array, string pattern, enum, const, integer, boolean)."""
    schema = SPEC.resolve(schema)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        optional = [k for k in props if k not in required]
        return st.builds(
            lambda req, opt: {**req, **opt},
            st.fixed_dictionaries({k: from_schema(props[k], depth + 1) for k in required}),
            st.fixed_dictionaries({}, optional={k: from_schema(props[k], depth + 1) for k in optional}),
        )
    if kind == "array":
        return st.lists(from_schema(schema["items"], depth + 1), max_size=min(schema.get("maxItems", 20), 20))
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=64)
    if kind == "integer":
        return st.integers(min_value=schema.get("minimum"), max_value=schema.get("maximum"))
    if kind == "number":
        return st.floats(min_value=schema.get("minimum"), max_value=schema.get("maximum"), allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    return st.none()


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
HOSTILE_TEXT = st.text(max_size=80) | st.sampled_from(["", ".", "..", "../..", "a/b", "%00", "\x00", "é", "x" * 300])


def path_value(target: Target, op: Operation, name: str) -> st.SearchStrategy[str]:
    schema = next(p["schema"] for p in _parameters(op) if p["name"] == name)
    valid = from_schema(schema).map(lambda v: quote(str(v), safe=""))
    hostile = HOSTILE_TEXT.map(lambda v: quote(v, safe=""))
    known: list[str] = []
    if op.method not in DESTRUCTIVE:
        known = [k for blocks in target.canaries.values() for k in blocks] if name == "key" else list(target.canaries)
    choices = [valid, valid, hostile] + ([st.sampled_from(known)] * 2 if known else [])
    return st.one_of(choices).filter(lambda v: not (op.method in DESTRUCTIVE and _is_canary(target, v)))


def _is_canary(target: Target, value: str) -> bool:
    return value in target.canaries or any(value in blocks for blocks in target.canaries.values())


def _parameters(op: Operation) -> list[dict[str, Any]]:
    item = SPEC.doc["paths"][op.path]
    return [SPEC.resolve(p) for p in (*item.get("parameters", ()), *op.doc.get("parameters", ()))]


def body_for(op: Operation) -> st.SearchStrategy[tuple[str | None, bytes]]:
    """(Content-Type, body) for ``op``."""
    content = SPEC.resolve(op.doc["requestBody"])["content"] if "requestBody" in op.doc else {}
    noise = st.binary(max_size=2048).map(lambda b: ("application/octet-stream", b))
    if "application/json" in content:
        valid = from_schema(content["application/json"]["schema"]).map(lambda v: json.dumps(v).encode())
        anything = ANY_JSON.map(lambda v: json.dumps(v).encode())
        charset = st.sampled_from(
            ["application/json", "application/json; charset=utf-8", "application/json; charset=bogus", "text/plain"]
        )
        return st.tuples(charset, st.one_of(valid, valid, anything)) | noise
    if "application/x-kvstore-batch" in content:
        items = st.lists(
            st.tuples(from_schema({"$ref": "#/components/schemas/Key"}), st.binary(min_size=1, max_size=5000)),
            max_size=6,
        )
        stream = items.map(batchframe.encode_put_stream)
        mutated = st.tuples(stream, st.integers(0, 10_000), st.binary(max_size=16)).map(
            lambda t: t[0][: t[1] % (len(t[0]) + 1)] + t[2] + t[0][t[1] % (len(t[0]) + 1) + len(t[2]) :]
        )
        return st.tuples(st.just(batchframe.CONTENT_TYPE), st.one_of(stream, mutated)) | noise
    if "application/octet-stream" in content:
        return st.tuples(st.just("application/octet-stream"), st.binary(min_size=0, max_size=20_000))
    return st.just((None, b""))


# Text int() or float() would read as a number, or that a lax reader takes
# for a boolean, none of them of the schema's type.
MISTYPED = st.sampled_from(
    ["+5", " 5", "5 ", "5_0", "1e3", "nan", "inf", "-1", "0x10", "\u0665", "\u00b2", "", "maybe"]
)


def query_for(op: Operation) -> st.SearchStrategy[tuple[str, bool]]:
    """A query string for ``op`` and whether a typed parameter in it has a
    value of another type (integers: digits; numbers: digits with a
    fraction; booleans: the schema's enum)."""
    params = [p for p in _parameters(op) if p["in"] == "query"]
    if not params:
        return st.just(("", False))
    pairs = []
    for p in params:
        schema = SPEC.resolve(p["schema"])
        typed = schema.get("type") in ("integer", "number") or "enum" in schema
        values = st.one_of(from_schema(schema).map(_query_text), HOSTILE_TEXT)
        mistyped = MISTYPED.filter(lambda v, s=schema: not _of_type(v, s)) if typed else st.nothing()
        pairs.append(
            st.one_of(values.map(lambda v: (v, False)), mistyped.map(lambda v: (v, True))).map(
                lambda vb, name=p["name"]: (f"{name}={quote(vb[0], safe='')}", vb[1])
            )
        )
    return st.lists(st.one_of(pairs), max_size=3).map(
        lambda xs: ("?" + "&".join(x for x, _ in xs) if xs else "", any(bad for _, bad in xs))
    )


def _query_text(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _of_type(text: str, schema: dict[str, Any]) -> bool:
    """Whether ``text`` is a value of ``schema``'s type as the API reads it."""
    if "enum" in schema:
        return text.lower() in schema["enum"]
    if schema.get("type") == "integer":
        return text.isascii() and text.isdigit()
    return bool(re.fullmatch(r"[0-9]+(\.[0-9]+)?", text))


HEADER_TEXT = st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " ", min_size=1, max_size=40)


def header_params(op: Operation) -> st.SearchStrategy[dict[str, str]]:
    """Values for ``op``'s header parameters (valid by their schema, or any
    text) and an Expect, each maybe absent."""
    params = [p for p in _parameters(op) if p["in"] == "header"]
    entries: dict[str, st.SearchStrategy[str]] = {
        p["name"]: from_schema(p["schema"]).map(str).filter(lambda v: v.isascii() and v.isprintable()) | HEADER_TEXT
        for p in params
    }
    entries["Expect"] = st.sampled_from(["100-continue", "100-Continue"]) | HEADER_TEXT
    return st.fixed_dictionaries({}, optional=entries)


@st.composite
def calls(draw: st.DrawFn, target: Target) -> Call:
    op = draw(st.sampled_from(OPERATIONS))
    path = op.path
    for p in _parameters(op):
        if p["in"] == "path":
            path = path.replace("{" + p["name"] + "}", draw(path_value(target, op, p["name"])))
    # Mostly the credential the route wants (so requests get past the gate),
    # else another tenant's, the wrong kind, none, or garbage.
    right = [ADMIN] if op.path.startswith("/v1/admin/") else list(target.tokens.values())
    wrong = st.sampled_from([f"Bearer {t}" for t in (*target.tokens.values(), ADMIN)] + [None, "Bearer", "Basic eA=="])
    garbage = st.text(alphabet=string.printable.strip("\r\n\x0b\x0c"), max_size=40).map(lambda t: "Bearer " + t)
    auth = draw(
        st.sampled_from(["right"] * 7 + ["wrong", "garbage", "bytes"]).flatmap(
            lambda kind: {
                "right": st.sampled_from([f"Bearer {t}" for t in right]),
                "wrong": wrong,
                "garbage": garbage,
                # Any byte but CR and LF (header injection is the raw-socket fuzzer's).
                "bytes": st.binary(min_size=1, max_size=20).map(
                    lambda b: "Bearer " + b.replace(b"\r", b"").replace(b"\n", b"").decode("latin-1")
                ),
            }[kind]
        )
    )
    headers = {"Authorization": auth} if auth is not None else {}
    content_type, body = draw(body_for(op))
    if content_type is not None:
        headers["Content-Type"] = content_type
    if op.path == "/v1/blocks/{key}" and op.method == "GET":
        rng = draw(st.none() | st.sampled_from(["bytes=0-0", "bytes=-10", "bytes=5-", "bytes=9-3", "bytes=0-1,4-5"]))
        if rng:
            headers["Range"] = rng
    if draw(st.integers(0, 3)) == 0:
        headers.update({k: v for k, v in draw(header_params(op)).items() if k not in headers})
    query, mistyped = draw(query_for(op))
    return Call(op, draw(st.sampled_from(target.roles)), path + query, headers, body, mistyped)


def test_api_fuzz_from_openapi(target: Target) -> None:
    problems: list[str] = []

    def one(call: Call) -> None:
        r = target.worker(call.role).request(call.op.method, call.target, call.headers, call.body)
        where = f"{call.role}: {call.op.method} {call.target[:120]} -> {r.status} {r.code}"
        assert r.status < 500 or r.code in RETRYABLE_5XX.get(r.status, ()), where
        found = SPEC.problems(call.op.method, call.op.path, r.status, r.content_type, r.body)
        assert not found, (where, found)
        if call.mistyped and r.status < 300:
            raise AssertionError(f"a query parameter of another type was taken: {where}")
        text = r.body.decode("latin-1")
        for name, value in call.headers.items():
            # (A value that is also in the request's path may be named as the path's: an
            # error says which path parameter is invalid, e.g. Expect "0000000:" beside
            # tenant "0000000%3A".)
            if name != "Content-Type" and len(value.strip()) >= 8 and value.strip() not in unquote(call.target):
                assert value.strip() not in text, (f"{name} echoed", where)
        if r.status == 200 and call.op.method == "GET" and call.op.path == "/v1/blocks/{key}":
            problems.extend(_foreign_block(target, call, r.body))
        assert not problems, problems

    fuzz(one, examples=600, call=calls(target))
    target.check()


def _foreign_block(target: Target, call: Call, body: bytes) -> list[str]:
    """A block served to one tenant must never be another tenant's canary."""
    token = call.headers.get("Authorization", "").removeprefix("Bearer ")
    mine = next((t for t, tok in target.tokens.items() if tok == token), None)
    return [
        f"{mine} read {other}'s block {key}"
        for other, blocks in target.canaries.items()
        if other != mine
        for key, data in blocks.items()
        if body == data
    ]

"""docs/openapi.yaml as tests use it: its operations, and whether an answer
is one it describes (status, content type, JSON schema)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

_URN = "urn:kvstore:openapi"
SPEC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
METHODS = ("get", "put", "post", "delete", "head", "patch", "options")
# Answers any request can get, described once in info.description rather than
# under each operation: the parser's 400 bad_request, 414 and 431, 408 for a
# request whose headers did not arrive in time, 404 for a path no route
# matches (an empty path parameter), 405 for a method a path does not have,
# 417 for an Expect other than 100-continue, 503 overloaded past
# max_concurrency, 505 for an HTTP version other than 1.0 and 1.1.
GLOBAL = {
    400: {"bad_request"},
    404: {"not_found"},
    405: {"method_not_allowed"},
    408: {"request_timeout"},
    414: {"uri_too_long"},
    417: {"expectation_failed"},
    431: {"headers_too_large"},
    503: {"overloaded"},
    505: {"http_version_not_supported"},
}


@dataclass(frozen=True)
class Operation:
    method: str  # upper case
    path: str  # as in the spec: /v1/blocks/{key}
    doc: dict[str, Any]


class Spec:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self._registry: Registry[Any] = Registry().with_resource(
            _URN, Resource.from_contents(doc, default_specification=DRAFT202012)
        )
        self._validators: dict[str, Draft202012Validator] = {}

    @classmethod
    @functools.cache
    def load(cls) -> Spec:
        return cls(yaml.safe_load(SPEC_PATH.read_text()))

    def operations(self) -> list[Operation]:
        return [
            Operation(method.upper(), path, op)
            for path, item in self.doc["paths"].items()
            for method, op in item.items()
            if method in METHODS
        ]

    def operation(self, method: str, path: str) -> Operation:
        op = self.doc["paths"][path][method.lower()]
        return Operation(method.upper(), path, op)

    def resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        """``node``, or what its ``$ref`` (within this document) points at."""
        while "$ref" in node:
            target: Any = self.doc
            for part in node["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            node = target
        return node

    def problems(self, method: str, path: str, status: int, content_type: str, body: bytes) -> list[str]:
        """What is wrong with an answer to ``method path`` (the spec's path
        pattern); empty if the spec describes it."""
        op = self.operation(method, path)
        responses = op.doc["responses"]
        code = _error_code(body) if content_type.startswith("application/json") else None
        if status in GLOBAL and code in GLOBAL[status]:
            return []  # an answer any request can get (parser errors, overload...)
        if str(status) not in responses:
            if status in GLOBAL and method == "HEAD":
                return []
            return [f"{method} {path}: status {status} ({code}) is not described"]
        response = self.resolve(responses[str(status)])
        content = response.get("content")
        if method == "HEAD" or not content or status in (204, 304):
            return []
        media = content_type.split(";")[0].strip()
        if media not in content:
            return [f"{method} {path} {status}: content type {media!r}, described: {sorted(content)}"]
        schema = content[media].get("schema")
        if media != "application/json" or schema is None:
            return []
        try:
            doc = json.loads(body)
        except ValueError as e:
            return [f"{method} {path} {status}: not JSON ({e})"]
        return [
            f"{method} {path} {status}: {e.json_path}: {e.message}"
            for e in self.schema_validator(schema).iter_errors(doc)
        ]

    def schema_validator(self, schema: dict[str, Any]) -> Draft202012Validator:
        """A JSON Schema 2020-12 validator for ``schema`` (a part of this
        document), its ``#/components/...`` refs resolved in this document."""
        key = json.dumps(schema, sort_keys=True)
        if key not in self._validators:
            self._validators[key] = Draft202012Validator(_rebase(schema), registry=self._registry)
        return self._validators[key]


def _rebase(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (_URN + v if k == "$ref" and v.startswith("#/") else _rebase(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase(v) for v in node]
    return node


def _error_code(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None

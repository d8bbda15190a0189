"""JSON from clients: parsed into 4xx errors, never a RecursionError, and
bounded in depth.

``json.loads`` recurses once per nested array or object: a few thousand
``[`` raise RecursionError, which is no ValueError and would escape as a 500
(with a traceback per request in the log). A document that parses can still
be deep enough to make every later ``repr``, ``json.dumps`` or msgpack
encoding of it fail (msgpack refuses more than 511 levels), so documents are
also held to :data:`MAX_DEPTH` as they come in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from kvstore.errors import InvalidInput

MAX_DEPTH = 64
"""Arrays and objects nested in a JSON document from a client, at most."""


def deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels in ``value``
    (a scalar is 0 levels, ``[]`` one, ``[{}]`` two). Iterative: any depth."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth + 1 > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def loads(raw: bytes | str, what: str, limit: int = MAX_DEPTH, expected: str = "a JSON object") -> Any:
    """The JSON value in ``raw``; ``400 invalid_input`` naming ``what`` when it
    is not JSON (``what`` must be ``expected``), nests more than ``limit``
    levels, or has a number of more than 4300 digits (CVE-2020-10735)."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise InvalidInput(f"{what}: arrays or objects nested more than {limit} deep") from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, int() over sys.get_int_max_str_digits()
        raise InvalidInput(f"{what} must be {expected}") from None
    if deeper_than(doc, limit):
        raise InvalidInput(f"{what}: arrays or objects nested more than {limit} deep")
    return doc

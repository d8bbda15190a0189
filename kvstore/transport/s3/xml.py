"""S3's XML: the documents the gateway answers and the few it accepts.

Answers are built as text with every value escaped (:func:`element`); request
bodies (CreateBucketConfiguration, Delete, CompleteMultipartUpload) are parsed
with the standard library's parser after refusing any DTD, so no entity is
ever expanded, and bounded in size by the caller.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
from datetime import UTC, datetime
from xml.sax.saxutils import escape

from kvstore.transport.s3.errors import S3Error

NS = "http://s3.amazonaws.com/doc/2006-03-01/"
HEADER = '<?xml version="1.0" encoding="UTF-8"?>\n'
MAX_BODY = 4 << 20  # a DeleteObjects of 1,000 keys of 1,024 bytes, or a Complete of 10,000 parts, fit


def element(name: str, value: str | int | bool | None) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"<{name}>{escape(str(value))}</{name}>"


def document(root: str, body: Iterable[str]) -> bytes:
    return (HEADER + f'<{root} xmlns="{NS}">' + "".join(body) + f"</{root}>").encode()


def iso_time(ns: int) -> str:
    """S3's timestamps in listings: 2026-11-23T10:00:00.000Z."""
    dt = datetime.fromtimestamp(ns / 1e9, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def http_time(ns: int) -> str:
    """RFC 9110's IMF-fixdate (Last-Modified)."""
    return datetime.fromtimestamp(ns // 1_000_000_000, UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")


def error_document(e: S3Error, resource: str, request_id: str) -> bytes:
    extra = "".join(element(k, v) for k, v in e.extra.items())
    return (
        HEADER
        + "<Error>"
        + element("Code", e.s3_code)
        + element("Message", e.message)
        + extra
        + element("Resource", resource)
        + element("RequestId", request_id)
        + "</Error>"
    ).encode()


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def parse(body: bytes, root: str) -> ET.Element:
    """The document's root element, which must be ``root`` (any or no namespace)."""
    if b"<!DOCTYPE" in body.upper() or b"<!ENTITY" in body.upper():
        raise S3Error(
            "MalformedXML", "The XML you provided was not well-formed or did not validate against our published schema"
        )
    try:
        doc = ET.fromstring(body)
    except ET.ParseError:
        raise S3Error(
            "MalformedXML", "The XML you provided was not well-formed or did not validate against our published schema"
        ) from None
    if _local(doc.tag) != root:
        raise S3Error("MalformedXML", f"expected a <{root}> document, got <{_local(doc.tag)[:64]}>")
    return doc


def children(node: ET.Element, name: str) -> list[ET.Element]:
    return [c for c in node if _local(c.tag) == name]


def text_of(node: ET.Element, name: str) -> str | None:
    found = children(node, name)
    if not found:
        return None
    return found[0].text or ""

"""ACLs: every bucket and object is its tenant's alone, whatever ACL a
request asks for. ACL requests (canned ``x-amz-acl`` values, ``x-amz-grant-*``
headers, PutBucketAcl and PutObjectAcl documents) are accepted, as
S3-compatible stores without ACLs accept them, and change nothing: access
can only be narrower than asked, never wider (an anonymous request is
refused whatever ACL was set). GetBucketAcl and GetObjectAcl report the ACL
in force: the owner's full control."""

from __future__ import annotations

from aiohttp import web

from kvstore.transport.s3.call import Call
from kvstore.transport.s3.errors import S3Error
from kvstore.transport.s3.xml import document, element, parse


def _policy(call: Call) -> bytes:
    owner = element("ID", call.tenant) + element("DisplayName", call.tenant)
    grant = (
        '<Grant><Grantee xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:type="CanonicalUser">'
        + owner
        + "</Grantee>"
        + element("Permission", "FULL_CONTROL")
        + "</Grant>"
    )
    return document(
        "AccessControlPolicy", ["<Owner>", owner, "</Owner>", "<AccessControlList>", grant, "</AccessControlList>"]
    )


async def _target_exists(call: Call) -> None:
    await call.bucket()
    if call.key is not None and call.catalog.get_now(str(call.bucket_name), call.key) is None:
        raise S3Error("NoSuchKey", "The specified key does not exist.", Key=call.key_text)


async def get_acl(call: Call) -> web.StreamResponse:
    await _target_exists(call)
    return web.Response(body=_policy(call), content_type="application/xml")


async def put_acl(call: Call) -> web.StreamResponse:
    """PutBucketAcl / PutObjectAcl: a well-formed request is accepted and
    changes nothing (see the module doc)."""
    await _target_exists(call)
    body = await call.xml_body()
    if body.strip():
        parse(body, "AccessControlPolicy")
    return web.Response(status=200)

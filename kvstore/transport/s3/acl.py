"""ACLs, as S3 answers them with Object Ownership "bucket owner enforced"
(S3's default for new buckets since 2023): every bucket and object belongs
to its tenant, ACLs are disabled. A request that would grant anything to
anyone else is refused (``AccessControlListNotSupported``); the canned
``private`` and ``bucket-owner-full-control`` ACLs, which grant nothing
more, are accepted; GetBucketAcl and GetObjectAcl answer the owner's full
control."""

from __future__ import annotations

from aiohttp import web

from kvstore.transport.s3.call import Call
from kvstore.transport.s3.errors import S3Error
from kvstore.transport.s3.xml import children, document, element, parse

NO_GRANTS = frozenset({"private", "bucket-owner-full-control"})
_REFUSED = "The bucket does not allow ACLs"


def check_acl_headers(call: Call, creating_bucket: bool = False) -> None:
    """Refuse ``x-amz-acl`` values and ``x-amz-grant-*`` headers that would
    grant access to anyone but the owner."""
    canned = call.request.headers.get("x-amz-acl")
    grants = [h for h in call.request.headers if h.lower().startswith("x-amz-grant-")]
    if (canned is not None and canned.strip().lower() not in NO_GRANTS) or grants:
        if creating_bucket:
            raise S3Error(
                "InvalidBucketAclWithObjectOwnership",
                "Bucket cannot have ACLs set with ObjectOwnership's BucketOwnerEnforced setting",
            )
        raise S3Error("AccessControlListNotSupported", _REFUSED)


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


async def get_acl(call: Call) -> web.StreamResponse:
    await call.bucket()
    if call.key is not None and await call.catalog.run(call.catalog.get, call.bucket_name, call.key) is None:
        raise S3Error("NoSuchKey", "The specified key does not exist.", Key=call.key_text)
    return web.Response(body=_policy(call), content_type="application/xml")


async def put_acl(call: Call) -> web.StreamResponse:
    """PutBucketAcl / PutObjectAcl: accepted when it grants the owner alone."""
    await call.bucket()
    if call.key is not None and await call.catalog.run(call.catalog.get, call.bucket_name, call.key) is None:
        raise S3Error("NoSuchKey", "The specified key does not exist.", Key=call.key_text)
    check_acl_headers(call)
    body = await call.xml_body()
    if body.strip():
        doc = parse(body, "AccessControlPolicy")
        for acl in children(doc, "AccessControlList"):
            for grant in children(acl, "Grant"):
                grantee = children(grant, "Grantee")
                ids = [c.text for g in grantee for c in g if c.tag.rpartition("}")[2] == "ID"]
                if ids != [call.tenant]:
                    raise S3Error("AccessControlListNotSupported", _REFUSED)
    return web.Response(status=200)

"""The S3-compatible gateway: a second listener that speaks S3's REST API.

It runs in the process that owns the store's writes (the single process, or
the writer of a multi-worker daemon), on its own address
(``s3_gateway_listen``), so S3's path layout (``/bucket/key``) never meets
``/v1``. Every request is authenticated with SigV4 (:mod:`.sigv4`) against
the access keys the admin API issues per tenant; a bucket belongs to the
tenant whose key created it. The gateway's lasting state is kept by
:mod:`kvstore.buckets`: objects are kvstore blocks of that tenant
(``objects``), named by the catalog (``catalog``), a cache of the gateway's
records (``records``: blocks of the same tenant, mirrored with its segments),
from which a node rebuilt from its bucket rebuilds it at start-up
(``recovery``). This package is the gateway's HTTP: SigV4, S3's XML and
errors, the operations.

Errors are S3's XML documents with a request id (``x-amz-request-id``); a
HEAD's error has no body, as S3's.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import unquote

from aiohttp import web

from kvstore.buckets import objects, recovery
from kvstore.buckets.catalog import Catalog
from kvstore.engine.api import Store
from kvstore.errors import KVStoreError
from kvstore.metrics import Metrics
from kvstore.qos.admission import Admission
from kvstore.server_config import ServerConfig
from kvstore.transport.http.appkeys import CONFIG, METRICS
from kvstore.transport.http.qos import ADMISSION, TICKET
from kvstore.transport.s3 import acl, bucket_ops, multipart_ops, object_ops
from kvstore.transport.s3.call import Call, Settings, validate_object_key
from kvstore.transport.s3.errors import S3Error, from_kvstore
from kvstore.transport.s3.sigv4 import RequestParts, check_scope_and_time, parse_authorization, parse_query, verify
from kvstore.transport.s3.xml import error_document
from kvstore.transport.statuses import http_status

log = logging.getLogger("kvstore.s3")

STORE = web.AppKey("s3_store", Store)
READERS = web.AppKey("s3_readers", objects.Readers)
CATALOG = web.AppKey("s3_catalog", Catalog)
SETTINGS = web.AppKey("s3_settings", Settings)
# On a fleet node: check the fleet's tenant registry now (an access key issued on
# another node since the last heartbeat's check; kvstore/fleet/node.confirm_registry).
CONFIRM: web.AppKey[Callable[[], Awaitable[None]]] = web.AppKey("s3_confirm_registry")
REQUEST_ID = web.RequestKey("s3_request_id", str)
OP = web.RequestKey("s3_op", str)

Op = Callable[[Call], Awaitable[web.StreamResponse]]

# Sub-resources the gateway does not implement: S3's 501 NotImplemented, by name.
_UNSUPPORTED = frozenset(
    {
        "acl",
        "policy",
        "cors",
        "lifecycle",
        "tagging",
        "website",
        "logging",
        "notification",
        "replication",
        "encryption",
        "object-lock",
        "retention",
        "legal-hold",
        "torrent",
        "accelerate",
        "requestPayment",
        "inventory",
        "analytics",
        "metrics",
        "intelligent-tiering",
        "ownershipControls",
        "publicAccessBlock",
        "restore",
        "select",
        "attributes",
        "policyStatus",
    }
)


def _route(method: str, has_key: bool, query: dict[str, str], headers: object) -> tuple[str, Op]:
    """(operation name, handler) of a request, as S3 routes it."""
    if "acl" in query and method in ("GET", "PUT"):
        return ("GetAcl", acl.get_acl) if method == "GET" else ("PutAcl", acl.put_acl)
    unsupported = _UNSUPPORTED.intersection(query)
    if unsupported:
        return "NotImplemented", _not_implemented(sorted(unsupported)[0])
    if not has_key:
        if method == "PUT":
            if "versioning" in query:
                return "PutBucketVersioning", bucket_ops.put_versioning
            return "CreateBucket", bucket_ops.create_bucket
        if method == "HEAD":
            return "HeadBucket", bucket_ops.head_bucket
        if method == "DELETE":
            return "DeleteBucket", bucket_ops.delete_bucket
        if method == "GET":
            if "location" in query:
                return "GetBucketLocation", bucket_ops.get_location
            if "versioning" in query:
                return "GetBucketVersioning", bucket_ops.get_versioning
            if "uploads" in query:
                return "ListMultipartUploads", multipart_ops.list_uploads
            if "versions" in query:
                return "ListObjectVersions", bucket_ops.list_object_versions
            return ("ListObjectsV2" if query.get("list-type") == "2" else "ListObjects"), bucket_ops.list_objects
        if method == "POST" and "delete" in query:
            return "DeleteObjects", bucket_ops.delete_objects
        return "MethodNotAllowed", _method_not_allowed
    if method == "PUT":
        if "uploadId" in query or "partNumber" in query:
            return "UploadPart", multipart_ops.upload_part
        if "x-amz-copy-source" in headers:  # type: ignore[operator]
            return "CopyObject", object_ops.copy_object
        return "PutObject", object_ops.put_object
    if method == "GET":
        if "uploadId" in query:
            return "ListParts", multipart_ops.list_parts
        return "GetObject", object_ops.get_object
    if method == "HEAD":
        return "HeadObject", _head_object
    if method == "DELETE":
        if "uploadId" in query:
            return "AbortMultipartUpload", multipart_ops.abort
        return "DeleteObject", object_ops.delete_object
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload", multipart_ops.create_upload
        if "uploadId" in query:
            return "CompleteMultipartUpload", multipart_ops.complete
    return "MethodNotAllowed", _method_not_allowed


async def _head_object(call: Call) -> web.StreamResponse:
    return await object_ops.get_object(call, head=True)


def _not_implemented(name: str) -> Op:
    async def op(call: Call) -> web.StreamResponse:
        raise S3Error("NotImplemented", f"the '{name}' sub-resource is not implemented by this gateway")

    return op


async def _method_not_allowed(call: Call) -> web.StreamResponse:
    raise S3Error("MethodNotAllowed", "The specified method is not allowed against this resource.")


def _target(request: web.Request) -> tuple[str, str]:
    """(raw path, raw query) of the request target as sent. An absolute-form
    target (``GET http://host:port/bucket/key HTTP/1.1``, RFC 9112 §3.2.2,
    which the AWS CRT sends) is reduced to its path and query, keeping
    their percent-encoding exactly as signed."""
    raw = request.raw_path
    if not raw.startswith("/"):
        _, sep, rest = raw.partition("://")
        raw = "/" + rest.partition("/")[2] if sep else "/" + raw
    path, _, query = raw.partition("?")
    return path, query


def _addressing(request: web.Request, domain: str | None) -> tuple[str | None, str]:
    """(bucket, raw key path) from a virtual-host-style Host or the path."""
    raw_path = _target(request)[0]
    host = (request.headers.get("Host") or "").rpartition(":")[0] or (request.headers.get("Host") or "")
    if domain and host.lower().endswith("." + domain):
        return host[: -len(domain) - 1].lower(), raw_path[1:]
    path = raw_path[1:]
    bucket, _, key = path.partition("/")
    return (unquote(bucket) or None), key


async def _authenticate(request: web.Request, settings: Settings, store: Store) -> tuple[Call, str]:
    raw_path, raw_query = _target(request)
    headers: dict[str, list[str]] = {}
    for name, value in request.headers.items():
        headers.setdefault(name.lower(), []).append(value)
    parts = RequestParts(request.method, raw_path, raw_query, headers)
    auth = parse_authorization(parts)
    if auth is None:
        raise S3Error("AccessDenied", "Access Denied: anonymous requests are not accepted; sign with SigV4")
    check_scope_and_time(auth, settings.region)
    found = store.s3_credentials(auth.access_key_id)
    if found is None and CONFIRM in request.app:  # a fleet node: maybe a key issued on another node just now
        await request.app[CONFIRM]()
        found = store.s3_credentials(auth.access_key_id)
    if found is None:
        raise S3Error(
            "InvalidAccessKeyId",
            "The AWS Access Key Id you provided does not exist in our records.",
            AWSAccessKeyId=auth.access_key_id[:64],
        )
    tenant, secret, incarnation = found
    key = verify(parts, auth, secret)
    bucket, raw_key = _addressing(request, settings.domain)
    query = dict(parse_query(raw_query))
    try:
        key_text = unquote(raw_key, errors="strict") if raw_key else ""
    except UnicodeDecodeError:
        raise S3Error("InvalidArgument", "the object key is not valid UTF-8") from None
    call = Call(
        request=request,
        store=store,
        catalog=request.app[CATALOG],
        settings=settings,
        tenant=tenant,
        incarnation=incarnation,
        auth=auth,
        signing_key=key,
        bucket_name=bucket,
        key=validate_object_key(key_text) if key_text else None,
        query=query,
        request_id=request[REQUEST_ID],
        readers=request.app[READERS],
    )
    return call, tenant


async def handle(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    store = request.app[STORE]
    call, tenant = await _authenticate(request, settings, store)
    # The worker's admission (kvstore/qos/admission.py), as on /v1: the
    # tenant's share of the requests in flight and a request of its QoS; a
    # PUT's bytes before its body is read; an object GET a slot of the fair
    # gate. Over a limit: SlowDown (503), S3's way to say "slow down".
    bulk = call.key is not None and request.method == "GET"
    ticket = await request.app[ADMISSION].enter(tenant, bulk=bulk)
    request[TICKET] = ticket
    try:
        if request.method == "PUT" and call.key is not None and request.content_length:
            await ticket.reserve("write", request.content_length)
            ticket.served("write", request.content_length)
        return await _serve(request, call)
    finally:
        ticket.close()


async def _serve(request: web.Request, call: Call) -> web.StreamResponse:
    if call.bucket_name is None:
        if request.method != "GET":
            raise S3Error("MethodNotAllowed", "The specified method is not allowed against this resource.")
        request[OP] = "ListBuckets"
        return await bucket_ops.list_buckets(call)
    name, op = _route(request.method, call.key is not None, call.query, request.headers)
    request[OP] = name
    version = call.query.get("versionId")
    if version is not None and version != "null":  # no bucket has versioning: its objects' one version is "null"
        raise S3Error("InvalidArgument", "Invalid version id specified", ArgumentName="versionId")
    return await op(call)


@web.middleware
async def s3_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every answer carries a request id; every error is S3's XML document
    (no body for a HEAD); counted by operation and status."""
    request_id = request.get(REQUEST_ID) or secrets.token_hex(8).upper()  # the 100-continue check's, if any
    request[REQUEST_ID] = request_id
    metrics = request.app[METRICS]
    t0 = time.perf_counter()
    status = "disconnected"
    try:
        try:
            resp = await handler(request)
        except KVStoreError as e:
            await _drain(request)
            resp = _error_response(request, from_kvstore(e), request_id)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            resp = _error_response(request, S3Error("InvalidRequest", e.reason), request_id)
        except (ConnectionError, OSError):
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.get(OP, "?"))
            resp = _error_response(
                request, S3Error("InternalError", "We encountered an internal error. Please try again."), request_id
            )
        status = str(resp.status)
        return resp
    finally:
        op = request.get(OP, "unknown")
        metrics.inc("kvstore_s3_requests_total", op=op, status=status)
        metrics.observe("kvstore_s3_request_seconds", time.perf_counter() - t0, op=op)


async def _stamp(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer, streamed ones included, names its request as S3's do."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["x-amz-request-id"] = request_id
        response.headers["x-amz-id-2"] = request_id
    response.headers["Server"] = "kvstore"


DRAIN_LIMIT = 8 << 20  # a refused request's unread body up to this is read and dropped
DRAIN_SECONDS = 5


async def _drain(request: web.Request) -> None:
    """Read and drop what is left of a refused request's body when it is
    small (as S3 reads the body it refuses), so the answer arrives on a
    connection the client can go on using; larger ones are cut instead."""
    if not request.can_read_body or request.content.is_eof():
        return
    length = request.content_length
    if length is None or length > DRAIN_LIMIT:
        return
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            while await request.content.read(1 << 20):
                pass
    except (TimeoutError, ConnectionError, web.HTTPException):
        return
    except Exception:  # noqa: BLE001 - a body that cannot even be drained: the connection is cut below
        return


def _error_response(request: web.Request, e: S3Error, request_id: str) -> web.Response:
    if e.status >= 500:
        log.error("%s %s: %s %s", request.method, request.get(OP, "?"), e.s3_code, e.message)
    resource = _target(request)[0]
    headers = {"x-amz-request-id": request_id, "x-amz-id-2": request_id}
    if e.s3_code in ("SlowDown", "ServiceUnavailable"):
        headers["Retry-After"] = "1"
    if request.method == "HEAD":
        return web.Response(status=e.status, headers=headers)
    resp = web.Response(
        status=e.status, body=error_document(e, resource, request_id), content_type="application/xml", headers=headers
    )
    if request.can_read_body and not request.content.is_eof():
        resp.force_close()  # the body was not read: the connection cannot carry another request
    return resp


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: the request is authenticated and its bucket
    checked first, as S3 does, so a client that would be refused learns it
    before it sends the body; then 100. Any other expectation is ignored, as
    S3 does (aiohttp would answer 417)."""
    if (request.headers.get("Expect") or "").lower() != "100-continue":
        return None
    request_id = request[REQUEST_ID] = secrets.token_hex(8).upper()
    try:
        call, _ = await _authenticate(request, request.app[SETTINGS], request.app[STORE])
        if call.bucket_name is not None and not (request.method == "PUT" and call.key is None):
            await call.bucket()  # every upload but CreateBucket names a bucket that must be the caller's
    except KVStoreError as e:
        request.app[METRICS].inc("kvstore_s3_requests_total", op="Expect", status=str(http_status(e)))
        resp = _error_response(request, from_kvstore(e), request_id)
        resp.force_close()  # the body it announced will not be read
        return resp
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


def settings_of(cfg: ServerConfig) -> Settings:
    return Settings(
        region=cfg.s3_gateway_region,
        domain=cfg.s3_gateway_domain,
        block_size=min(objects.OBJECT_BLOCK, cfg.store.max_block_size),
    )


def make_gateway_app(
    store: Store,
    metrics: Metrics,
    cfg: ServerConfig,
    admission: Admission | None = None,
    confirm_registry: Callable[[], Awaitable[None]] | None = None,
) -> web.Application:
    """The gateway's application over an open store (the daemon's
    configuration: its time limits and sendfile apply here too; ``admission``:
    the worker's, so a tenant's limits, weight and shares hold on both APIs
    together; ``confirm_registry``: a fleet node's check of the fleet's
    tenant registry, for an access key it does not know)."""
    settings = settings_of(cfg)
    app = web.Application(middlewares=[s3_errors], client_max_size=1 << 20)
    app[STORE] = store
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[CONFIG] = cfg
    if admission is None:  # a gateway of its own (tests): its own admission, without QoS
        admission = Admission(metrics, cfg.max_concurrency, cfg.max_buffered_body_bytes, store.config.max_block_size)
        admission.ready = True
    app[ADMISSION] = admission
    if confirm_registry is not None:
        app[CONFIRM] = confirm_registry

    async def catalog_ctx(app: web.Application) -> AsyncIterator[None]:
        catalog = Catalog(store.config.data_dir / "s3" / "catalog.sqlite3")
        app[CATALOG] = catalog
        app[READERS] = readers = objects.Readers(store)
        # The catalog in line with the records (rebuilt from them on a new
        # disk) before anything is served, and before the orphan sweep, which
        # must see every block a surviving record names.
        report = await recovery.recover(store, catalog, settings.region)
        if report.complete:
            await objects.sweep_orphans(store, catalog)
        yield
        await readers.close()
        await catalog.run(lambda: None)  # let the last change finish
        catalog.close()

    app.cleanup_ctx.append(catalog_ctx)
    app.on_response_prepare.append(_stamp)
    for method in ("GET", "PUT", "POST", "DELETE", "HEAD"):
        app.router.add_route(method, "/{tail:.*}", handle, expect_handler=_expect)
    return app

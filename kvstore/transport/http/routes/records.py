"""Records as stored, for clients that decode them themselves.

``GET /v1/records/{key}`` answers the stored frames that cover the block
(or the bytes a ``Range`` names), sent as they are on disk (sendfile from a
local segment), with what opens exactly those frames: the frame table and,
for a sealed tenant, the record's own derived key (never the tenant's data
key). The daemon neither decrypts nor decompresses; the client checks each
frame's xxh3-64 and GCM tag and decodes, in parallel, into its own buffer.

A record's key is handed out only where no one else can read it: over TLS,
a unix socket, or a loopback connection (``403 insecure_transport``
elsewhere). The answer is ``Cache-Control: no-store``.

The envelope (docs/API.md, "Records as stored") is the client's wire
format, defined once: kvstore_client/wire/envelope.py.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from aiohttp import web
from kvstore_client.wire.envelope import RecordMeta, StoredFrame, meta_doc, pack_head

from kvstore.engine.api import CODEC_NAMES, StoredFrames
from kvstore.errors import InsecureTransport
from kvstore.names import validate_key
from kvstore.transport.http.auth import tenant_of
from kvstore.transport.http.ranges import etag_matches, parse_range, range_spec_count
from kvstore.transport.http.routes.blocks import etag, head_anywhere, send_bytes, take_read

routes = web.RouteTableDef()
RECORD_TYPE = "application/vnd.kvstore.record"


def client_decode_allowed(transport: Any) -> bool:
    """Whether a record's key may go out on this connection: TLS, a unix
    socket, or a peer on a loopback address (127.0.0.0/8, ::1, and
    IPv4-mapped loopback)."""
    if transport is None or transport.is_closing():
        return False
    if transport.get_extra_info("sslcontext") is not None:
        return True
    if isinstance(transport.get_extra_info("sockname"), str | bytes):
        return True  # AF_UNIX: the socket file's mode and group decide who connects
    peer = transport.get_extra_info("peername")
    if not isinstance(peer, tuple) or not peer:
        return False
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def record_meta(tenant: str, key: str, size: int, start: int, end: int, f: StoredFrames) -> dict[str, Any]:
    """What a client needs to check and open frames ``f.first``..``f.last``
    and cut bytes [start, end) of the block from them."""
    h = f.header
    frames = tuple(StoredFrame(e.stored_len, CODEC_NAMES[e.codec], e.checksum) for e in h.frames[f.first : f.last + 1])
    meta = RecordMeta(
        tenant=tenant,
        key=key,
        size=size,
        start=start,
        end=end,
        record_id=h.record_id,
        key_version=h.key_version,
        frame_size=h.frame_size,
        frame_count=len(h.frames),
        first=f.first,
        frames=frames,
        frame_key=f.frame_key,
    )
    return meta_doc(meta)


@routes.get("/v1/records/{key}", allow_head=False)
async def get_record(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    key = validate_key(request.match_info["key"])
    if not client_decode_allowed(request.transport):
        raise InsecureTransport(
            "a record is sent with its own key only over TLS, a unix socket or loopback; "
            "use GET /v1/blocks/{key} (the daemon decodes) on this connection"
        )
    store, info = await head_anywhere(request, tenant, key)  # (a dead node's block this node took over too)
    headers = {"ETag": etag(info.etag), "Accept-Ranges": "bytes", "Cache-Control": "no-store"}
    if etag_matches(request.headers.get("If-None-Match"), headers["ETag"]):
        return web.Response(status=304, headers=headers)
    header = request.headers.get("Range")
    ranges = parse_range(header, info.size)
    one = ranges is not None and range_spec_count(header) == 1  # several range-specs: the whole block, as GET
    start, end = (ranges[0].start, ranges[0].end) if ranges is not None and one else (0, info.size)
    await take_read(request, end - start)
    rec = await store.get_stored(tenant, key, start, end)
    try:
        headers["ETag"] = etag(rec.frames.header.record_id.hex())  # the record sent, written again or not
        meta = record_meta(tenant, key, rec.frames.header.logical_size, rec.start, rec.end, rec.frames)
        return await send_bytes(request, rec.body, 200, headers, head=pack_head(meta), content_type=RECORD_TYPE)
    finally:
        rec.release()

"""Reader workers forward writes to the writer worker over a unix socket.

With several worker processes, one (the writer) owns the store's writes:
segment appends, index commits, the registry. The others open the store for
reads and serve GET, HEAD, lookup, batch get and stats themselves; every
write and every admin call is relayed, body streamed, to the writer, which
authenticates and answers it as if it had come in directly.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from kvstore.errors import StoreClosed
from kvstore.names import validate_key
from kvstore.transport.http_blocks import check_length
from kvstore.transport.http_common import config_of, store_of

WRITER = web.AppKey("writer", aiohttp.ClientSession)
_SENT = ("Authorization", "Content-Type", "Content-Length", "If-None-Match", "Range")
_RETURNED = ("Content-Type", "ETag", "WWW-Authenticate", "Retry-After", "Content-Range", "Allow")
_READS = {("POST", "/v1/lookup"), ("POST", "/v1/batch/get"), ("GET", "/v1/stats")}


def is_write(request: web.Request) -> bool:
    """Whether the request changes the store (and so belongs to the writer)."""
    path, method = request.path, request.method
    if path.startswith("/v1/admin/"):
        return True
    if path.startswith("/v1/blocks/"):
        return method in ("PUT", "DELETE")
    return path.startswith("/v1/") and (method, path) not in _READS and method not in ("GET", "HEAD")


async def forward(request: web.Request) -> web.StreamResponse:
    if request.method == "PUT" and request.path.startswith("/v1/blocks/"):
        # Refuse what the writer would refuse before streaming a body to it.
        validate_key(request.match_info["key"])
        check_length(request, store_of(request).config.max_block_size)
    headers = {h: request.headers[h] for h in _SENT if h in request.headers}
    body = request.content if request.body_exists else None
    timeout = aiohttp.ClientTimeout(total=None, sock_read=config_of(request).request_timeout_s)
    try:
        async with request.app[WRITER].request(
            request.method, "http://writer" + request.rel_url.path_qs, headers=headers, data=body, timeout=timeout
        ) as r:
            resp = web.StreamResponse(status=r.status, headers={h: r.headers[h] for h in _RETURNED if h in r.headers})
            if r.content_length is not None:
                resp.content_length = r.content_length
            await resp.prepare(request)
            async for chunk in r.content.iter_chunked(1 << 20):
                await resp.write(chunk)
            await resp.write_eof()
            return resp
    except (aiohttp.ClientError, ConnectionError) as e:
        raise StoreClosed(f"the writer process is unavailable ({type(e).__name__}); retry") from None

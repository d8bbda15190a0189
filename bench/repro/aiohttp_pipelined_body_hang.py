"""aiohttp's server stops answering pipelined requests that follow a request
whose body spans two reads: a reproducer for an upstream report, against a
plain aiohttp application (nothing of kvstore).

The client sends a PUT's headers and half its body, waits, then sends the
rest of the body and N pipelined GETs in one write. Every request is
complete, so N + 1 answers are due at once. With aiohttp 3.14.5 (its C
parser) the answers stop at 48 once N is 48 or more, and the connection
then waits for the keep-alive timeout (75 s) or the client's next bytes;
with AIOHTTP_NO_EXTENSIONS=1 (the pure-Python parser) all N + 1 come.

Why, as far as reading the source shows: the C parser counts a message in
its queue when the message ends (``cb_on_message_complete``), while the
protocol takes a message off the queue, and frees its slot
(``message_consumed``, which stops at zero), as soon as its headers are
parsed. A PUT taken before its body ended is counted after its slot was
freed: one slot is held for good. The parser then pauses one message short
of the limit (32), keeping the rest of the read as its tail, while the
protocol's queue (31) is under the limit at which it pauses the transport;
so nothing feeds the parser again when the queue drains
(``_resume_reading_if_drained`` runs only after such a pause), and the tail
waits for more bytes. (48 rather than 32 answers: the PUT handler's read
feeds the parser once more, the queue reaches 32 and pauses, and its resume
at 16 lets 15 more through before the parser stops one short again.)

    python bench/repro/aiohttp_pipelined_body_hang.py [N ...]
"""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
from aiohttp import web

WAIT_S = 5.0  # answers due at once; the keep-alive timeout is 75 s


async def put(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(text=f"{len(body)}\n")


async def get(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def answers_to(port: int, pipelined: int) -> int:
    """How many answers a client gets within WAIT_S for a PUT whose body
    comes in two writes, the second followed by ``pipelined`` GETs."""
    body = b"x" * 1000
    head = b"PUT /put HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % len(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body[:500])
    await writer.drain()
    await asyncio.sleep(0.2)  # the server reads the first half on its own
    writer.write(body[500:] + b"GET /get HTTP/1.1\r\nHost: localhost\r\n\r\n" * pipelined)
    await writer.drain()
    received = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while received.count(b"HTTP/1.1 ") < pipelined + 1:
        try:
            chunk = await asyncio.wait_for(reader.read(1 << 16), max(0.01, deadline - loop.time()))
        except TimeoutError:
            break
        if not chunk:
            break
        received += chunk
    writer.close()
    return received.count(b"HTTP/1.1 ")


async def main(counts: list[int]) -> int:
    app = web.Application()
    app.router.add_put("/put", put)
    app.router.add_get("/get", get)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    extensions = "off (pure Python)" if os.environ.get("AIOHTTP_NO_EXTENSIONS") else "on"
    print(f"aiohttp {aiohttp.__version__}, Python {sys.version.split()[0]}, C extensions {extensions}")
    hung = 0
    try:
        for n in counts:
            got = await answers_to(port, n)
            hung += got < n + 1
            verdict = "ok" if got == n + 1 else f"HUNG: {n + 1 - got} unanswered after {WAIT_S:g} s"
            print(f"PUT (body over two reads) + {n} pipelined GETs: {got} of {n + 1} answers  {verdict}")
    finally:
        await runner.cleanup()
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main([int(a) for a in sys.argv[1:]] or [10, 46, 47, 48, 60, 100])))

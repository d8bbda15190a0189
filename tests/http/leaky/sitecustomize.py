"""Fault injection for tests/http/test_hostile.py: a careless library inside
the daemon that logs request headers and exceptions through a handler of its
own, added after start-up. The daemon loads it through PYTHONPATH (Python
imports ``sitecustomize`` at start); nothing else uses it."""

from __future__ import annotations

import logging
import os

from aiohttp import web

from kvstore.transport.http import app

_healthz = app.healthz


async def leaky_healthz(request: web.Request) -> web.Response:
    leaky = logging.getLogger("leaky")
    if not leaky.handlers:  # added late, after the daemon configured logging
        leaky.addHandler(logging.FileHandler(os.environ["LEAKY_LOG"]))
        leaky.propagate = False
        logging.getLogger().addHandler(logging.FileHandler(os.environ["LEAKY_LOG"] + ".root"))
    secret = request.headers.get("X-Secret", "")
    leaky.warning("request headers: %s", dict(request.headers))
    leaky.warning("Authorization: %s", request.headers.get("Authorization"))
    logging.getLogger("kvstore.leaky").warning("the secret is %s, as %r", secret, secret.encode())
    try:
        raise RuntimeError(f"failed with {secret}")
    except RuntimeError:
        leaky.exception("oops: %r", secret)
        logging.getLogger("kvstore.leaky").exception("oops: %s", secret)
    return await _healthz(request)


app.healthz = leaky_healthz

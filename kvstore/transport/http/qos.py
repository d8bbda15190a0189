"""The worker's admission on the HTTP API (and the unix socket, the S3
gateway and NIXL's control calls, which pass the same application): where
the application keeps it, which routes are bulk reads, and each request's
ticket (kvstore/qos/admission.py decides; this module only carries).
"""

from __future__ import annotations

from aiohttp import web

from kvstore.qos.admission import Admission, Ticket

# Routes whose answers move blocks' bytes out: they pass the fair gate for
# the whole request. A block write takes a slot for its store only, once its
# body is in (Ticket.transfer): a slot held while a body trickles in would be
# the stalled-body attack again (a client decides how long a body takes).
# While it arrives, a write is bounded by its tenant's write limit and its
# weighted shares of the body budget and of the requests in flight (shares.py).
BULK = frozenset(
    {
        ("GET", "/v1/blocks/{key}"),
        ("GET", "/v1/records/{key}"),
        ("POST", "/v1/batch/get"),
        ("POST", "/v1/xfer/read"),
    }
)

ADMISSION = web.AppKey("admission", Admission)
TICKET = web.RequestKey("ticket", Ticket)  # the request's, from the gate (middleware.gate_middleware)


def ticket_of(request: web.Request) -> Ticket:
    """The request's ticket: its tenant's (the gate admitted it), or one of
    no tenant's for the admin's and the probes' requests."""
    ticket = request.get(TICKET)
    return ticket if ticket is not None else request.app[ADMISSION].untenanted()

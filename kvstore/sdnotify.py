"""systemd's notify protocol (sd_notify(3)) without libsystemd.

Under ``Type=notify`` systemd passes the path of a datagram socket in
``$NOTIFY_SOCKET``; the daemon reports its state by sending newline-separated
``NAME=value`` assignments to it: ``READY=1`` once it serves, ``STATUS=...``
for ``systemctl status``, ``STOPPING=1`` when it begins to shut down,
``WATCHDOG=1`` as a keep-alive, ``EXTEND_TIMEOUT_USEC=...`` during a long
start. Without systemd (``$NOTIFY_SOCKET`` unset) every call does nothing and
returns False, so the daemon behaves the same either way. A failed send is
logged, never raised: the notification is advisory, serving is not.

With ``WatchdogSec=`` systemd also sets ``$WATCHDOG_USEC`` (and
``$WATCHDOG_PID``); :func:`watchdog_interval` turns it into a ping period and
:func:`watchdog_loop` pings while the daemon reports itself healthy, so a
wedged store (or a blocked event loop, which stops the loop too) misses its
pings and systemd kills and restarts the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

# How long a send may block when systemd's receive queue is full; the sender is
# usually the event loop, so this is kept short.
SEND_TIMEOUT_S = 1.0


def _address(value: str) -> str | None:
    """The AF_UNIX address named by ``$NOTIFY_SOCKET``: a path, or ``@name`` for the abstract namespace."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None  # e.g. "vsock:CID:PORT" (systemd 253+): not supported here


def notify(*states: str) -> bool:
    """Send ``states`` (``"READY=1"``, ``"STATUS=..."``, ...) to systemd as one datagram.

    Returns True when it was sent; False when ``$NOTIFY_SOCKET`` is unset (not
    running under systemd's notify supervision), when there is nothing to send,
    or when sending failed (logged as a warning).
    """
    target = os.environ.get("NOTIFY_SOCKET")
    if not target or not states:
        return False
    address = _address(target)
    if address is None:
        log.warning("NOTIFY_SOCKET=%r: not an AF_UNIX socket path or @abstract name; not notifying", target)
        return False
    # One assignment per line: a newline inside a value (say a STATUS built from
    # an error message) would otherwise start a new, unintended assignment.
    message = "\n".join(" ".join(state.splitlines()) for state in states).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.sendto(message, address)
    except (OSError, ValueError) as e:  # ValueError: a path Python refuses (say, too long for sun_path)
        log.warning("sd_notify %s to NOTIFY_SOCKET=%r failed: %s", "/".join(states), target, e)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings: half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled(3) advises.

    None when the watchdog is off: ``$WATCHDOG_USEC`` unset or not a positive
    integer, or ``$WATCHDOG_PID`` set to another process's id (the variables
    were inherited, the watchdog is not ours).
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        if not pid.isdigit():
            log.warning("WATCHDOG_PID=%r is not a process id; watchdog off", pid)
            return None
        if int(pid) != os.getpid():
            return None
    if not usec.isdigit() or int(usec) == 0:
        log.warning("WATCHDOG_USEC=%r is not a positive integer; watchdog off", usec)
        return None
    return int(usec) / 2 / 1_000_000


async def watchdog_loop(interval: float, healthy: Callable[[], bool]) -> None:
    """Send ``WATCHDOG=1`` every ``interval`` seconds while ``healthy()``; runs until cancelled.

    While ``healthy()`` is false (or raises) no ping is sent; if that lasts
    longer than ``WatchdogSec=`` systemd deems the service hung and restarts it.
    Pings resume if it turns healthy again in time. The first check is at once.
    """
    if not interval > 0:
        raise ValueError(f"watchdog interval must be positive, not {interval!r}")
    was_healthy = True
    while True:
        try:
            ok = bool(healthy())
        except Exception:
            if was_healthy:
                log.exception("watchdog health check failed; withholding WATCHDOG=1")
            ok, was_healthy = False, False
        if ok:
            if not was_healthy:
                log.warning("healthy again; resuming watchdog pings")
            notify("WATCHDOG=1")
        elif was_healthy:
            log.warning("not healthy: withholding WATCHDOG=1 (systemd restarts the service after WatchdogSec=)")
        was_healthy = ok
        await asyncio.sleep(interval)

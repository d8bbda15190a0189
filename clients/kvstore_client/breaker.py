"""A per-endpoint circuit breaker: stop calling a dead server for a while."""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    """closed -> open after ``threshold`` consecutive failures -> half-open after
    ``cooldown`` s (one probe at a time) -> closed on the probe's success, open again on its failure."""

    def __init__(self, threshold: int, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.clock = clock
        self.state = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.probe_at: float | None = None
        self.trips = 0

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        now = self.clock()
        if self.state == "open":
            if now - self.opened_at < self.cooldown:
                return False
            self.state = "half-open"
        # half-open: one probe; a probe that never reported (cancelled) expires after the cooldown
        if self.probe_at is not None and now - self.probe_at < self.cooldown:
            return False
        self.probe_at = now
        return True

    def probe_now(self) -> None:
        """Something other than a call says the server is back (a fleet's
        membership lists it alive again): let the next call through as the
        probe, instead of waiting out the cooldown."""
        if self.state == "open":
            self.state = "half-open"
            self.probe_at = None

    def success(self) -> None:
        self.state = "closed"
        self.failures = 0
        self.probe_at = None

    def failure(self) -> None:
        self.probe_at = None
        if self.state == "half-open":
            self._open()
            return
        self.failures += 1
        if self.state == "closed" and self.failures >= self.threshold:
            self._open()

    def _open(self) -> None:
        self.state = "open"
        self.opened_at = self.clock()
        self.trips += 1

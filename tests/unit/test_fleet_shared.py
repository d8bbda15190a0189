"""A fleet node's writer tells its reader workers its fleet state through a
page of shared memory (kvstore/fleet/shared.py): what it publishes is what
they read, a torn record is never taken, and a state the writer stopped
renewing reads as fenced."""

from __future__ import annotations

import os
import struct

import pytest

from kvstore.errors import Fenced
from kvstore.fleet.shared import READ_EVERY_S, FleetFollower, FleetState, publish, read, shared_state


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_what_the_writer_publishes_the_readers_read() -> None:
    fd = shared_state()
    try:
        assert read(fd) is None  # nothing yet
        state = FleetState("not alive", "registry unknown", 2, 7, 99.5)
        publish(fd, state)
        assert read(fd) == state
        publish(fd, FleetState(fenced="x" * 5000, stamp=1.0))  # a long reason is cut, never spills
        got = read(fd)
        assert got is not None and got.fenced == "x" * 1000
        os.pwrite(fd, struct.pack("<II", 10, 12345), 0)  # a record whose checksum fails: not taken
        assert read(fd) is None
    finally:
        os.close(fd)


def test_a_follower_sees_changes_and_a_writer_that_stopped() -> None:
    fd, clock = shared_state(), Clock()
    follower = FleetFollower(fd, stale_after_s=3.0, clock=clock)
    try:
        assert "not published" in follower.fenced()  # nothing yet: fenced
        publish(fd, FleetState(stamp=clock.now))
        clock.now += 2 * READ_EVERY_S
        assert follower.fenced() == "" and follower.tenants_fenced() == "" and follower.takeovers() == 0
        follower.check_tenants()
        publish(fd, FleetState(tenants_fenced="cannot read the registry", takeovers=1, stamp=clock.now))
        assert follower.takeovers() == 0  # read at most every READ_EVERY_S
        clock.now += 2 * READ_EVERY_S
        assert follower.takeovers() == 1
        with pytest.raises(Fenced, match="tenant operations: cannot read the registry"):
            follower.check_tenants()
        publish(fd, FleetState(stamp=clock.now))
        clock.now += 3.5  # the writer published nothing since (3.5 s: past stale_after_s)
        assert "for 3.5 s" in follower.fenced() and "for 3.5 s" in follower.tenants_fenced()
    finally:
        follower.close()
        os.close(fd)


def test_a_reader_sees_the_writers_fences_go_up_with_no_lag() -> None:
    """The fences time raises (no heartbeat, no confirmed registry) are
    published as deadlines: a reader sees them go up at the same moment as
    the writer, not a publication later."""
    fd, clock = shared_state(), Clock()
    follower = FleetFollower(fd, stale_after_s=3.0, clock=clock)
    try:
        publish(fd, FleetState(stamp=clock.now, fence_at=clock.now + 1.0, tenants_fence_at=clock.now + 2.0))
        assert follower.fenced() == "" and follower.tenants_fenced() == ""
        clock.now += 1.5  # nothing published since: not stale yet, but the write fence is due
        assert "heartbeat is 0.5 s past due" in follower.fenced()
        assert follower.tenants_fenced() == ""
        clock.now += 1.0
        assert "registry is 0.5 s past due" in follower.tenants_fenced()
    finally:
        follower.close()
        os.close(fd)

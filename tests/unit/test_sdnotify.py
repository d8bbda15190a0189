"""sdnotify.py: the sd_notify(3) datagram protocol, against real AF_UNIX sockets."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore import sdnotify

ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start outside systemd even when pytest itself runs under it."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's, bound to a path and named in NOTIFY_SOCKET."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def pending(sock: socket.socket) -> list[bytes]:
    """Every datagram queued on ``sock`` now, without waiting."""
    out = []
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(timeout)


def test_no_socket_does_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert sdnotify.notify("READY=1") is False
    assert caplog.records == []


def test_empty_socket_variable_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert sdnotify.notify("READY=1") is False


def test_sends_states_as_one_datagram(listener: socket.socket) -> None:
    assert sdnotify.notify("READY=1", "STATUS=serving on 127.0.0.1:8420") is True
    assert listener.recv(4096) == b"READY=1\nSTATUS=serving on 127.0.0.1:8420"
    assert sdnotify.notify("STOPPING=1") is True
    assert listener.recv(4096) == b"STOPPING=1"
    assert pending(listener) == []


def test_nothing_to_send(listener: socket.socket) -> None:
    assert sdnotify.notify() is False
    assert pending(listener) == []


def test_newline_in_a_value_cannot_inject_an_assignment(listener: socket.socket) -> None:
    assert sdnotify.notify("STATUS=disk error\nMAINPID=1") is True
    assert listener.recv(4096) == b"STATUS=disk error MAINPID=1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the abstract socket namespace is Linux-only")
def test_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"kvstore-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("READY=1") is True
        assert sock.recv(4096) == b"READY=1"


def test_send_failure_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    with caplog.at_level(logging.WARNING, logger="kvstore.sdnotify"):
        assert sdnotify.notify("READY=1") is False
    assert "READY=1" in caplog.text and "nobody-listens" in caplog.text


def test_path_too_long_is_logged_not_raised(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/" + "x" * 300)
    with caplog.at_level(logging.WARNING, logger="kvstore.sdnotify"):
        assert sdnotify.notify("READY=1") is False
    assert "failed" in caplog.text


@pytest.mark.parametrize("value", ["relative/notify", "@", "vsock:2:1234"])
def test_unsupported_address_is_logged(
    value: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    with caplog.at_level(logging.WARNING, logger="kvstore.sdnotify"):
        assert sdnotify.notify("READY=1") is False
    assert repr(value) in caplog.text


def test_watchdog_interval_unset() -> None:
    assert sdnotify.watchdog_interval() is None


def test_watchdog_interval_is_half_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert sdnotify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_USEC", "1")
    assert sdnotify.watchdog_interval() == 0.0000005


def test_watchdog_for_another_process_is_not_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sdnotify.watchdog_interval() is None


@pytest.mark.parametrize(
    ("usec", "pid"), [("0", None), ("-5", None), ("abc", None), ("1.5e6", None), (" 30000000", None), ("30000000", "x")]
)
def test_watchdog_invalid_values_turn_it_off(usec: str, pid: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        monkeypatch.setenv("WATCHDOG_PID", pid)
    assert sdnotify.watchdog_interval() is None


async def wait_for_pings(sock: socket.socket, n: int, timeout: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    async with asyncio.timeout(timeout):
        while len(got) < n:
            got += pending(sock)
            await asyncio.sleep(0.005)
    return got


async def test_watchdog_loop_pings_only_while_healthy(
    listener: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    interval = 0.02
    state = {"healthy": True}
    task = asyncio.create_task(sdnotify.watchdog_loop(interval, lambda: state["healthy"]))
    try:
        assert set(await wait_for_pings(listener, 3)) == {b"WATCHDOG=1"}

        state["healthy"] = False
        await asyncio.sleep(2 * interval)  # a ping may have been in flight when the state changed
        pending(listener)
        await asyncio.sleep(10 * interval)
        assert pending(listener) == [], "pinged while unhealthy"
        assert "withholding WATCHDOG=1" in caplog.text

        state["healthy"] = True
        assert set(await wait_for_pings(listener, 2)) == {b"WATCHDOG=1"}
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_watchdog_loop_treats_a_failing_check_as_unhealthy(
    listener: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> bool:
        raise RuntimeError("store wedged")

    task = asyncio.create_task(sdnotify.watchdog_loop(0.01, broken))
    try:
        await asyncio.sleep(0.1)
        assert pending(listener) == []
        assert not task.done()
        assert "store wedged" in caplog.text
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_watchdog_loop_without_systemd_is_harmless() -> None:
    task = asyncio.create_task(sdnotify.watchdog_loop(0.01, lambda: True))
    await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
async def test_watchdog_loop_refuses_a_bad_interval(interval: float) -> None:
    with pytest.raises(ValueError, match="interval"):
        await sdnotify.watchdog_loop(interval, lambda: True)

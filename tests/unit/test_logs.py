"""Log lines (kvstore/logs.py): text for people, JSON for collectors, the
record's fields in both, and secrets scrubbed from both.

Used to be: text only, and the recovery report at start-up a Python dict's
repr inside the message ("store open at /data: {'index_rebuilt': False, ...}").
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from kvstore import logs
from kvstore.engine.recovery import RecoveryReport
from kvstore.redaction import REDACTED, Scrubber, install

ADMIN = "an-admin-token-of-some-length-0123456789"
KEY = os.urandom(32)
REPORT = RecoveryReport(
    index_rebuilt=True,
    segments=3,
    records_replayed=7,
    truncated=[("alice/0000000000000001.seg", 8192, 5008)],
    orphans_removed=["ghost"],
).as_dict()


@pytest.fixture
def daemon_logging(request: pytest.FixtureRequest) -> Iterator[io.StringIO]:
    """Logging set up as the daemon sets it up (kvstore/daemon/main.py): the
    format's handler on the root logger, then the scrubber installed. Undone
    after."""
    fmt: str = request.param
    factory = logging.getLogRecordFactory()
    root = logging.getLogger()
    level = root.level
    stream = io.StringIO()
    handler = logs.setup("info", fmt, stream)
    scrubber = Scrubber()
    try:
        install(scrubber)
        scrubber.add_secret(ADMIN)
        scrubber.add_key(KEY)
        yield stream
    finally:
        logging.setLogRecordFactory(factory)
        root.removeHandler(handler)
        root.setLevel(level)
        for h in root.handlers:
            h.removeFilter(scrubber)


@pytest.mark.parametrize("daemon_logging", ["json"], indirect=True)
def test_json_lines_carry_time_level_logger_message_and_fields(daemon_logging: io.StringIO) -> None:
    log = logging.getLogger("kvstore.node")
    before = datetime.now(UTC)
    log.info("store open at %s", "/var/lib/kvstore", extra=REPORT)
    log.warning("plain")
    first, second = (json.loads(line) for line in daemon_logging.getvalue().splitlines())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"]), first["time"]
    when = datetime.fromisoformat(first["time"].replace("Z", "+00:00"))
    assert before - timedelta(seconds=1) <= when <= datetime.now(UTC)
    assert (first["level"], first["logger"], first["message"]) == (
        "info",
        "kvstore.node",
        "store open at /var/lib/kvstore",
    )
    assert {k: first[k] for k in REPORT} == json.loads(json.dumps(REPORT))  # every field, as JSON types
    assert first["truncated"] == [{"segment": "alice/0000000000000001.seg", "offset": 8192, "bytes": 5008}]
    assert second == {"time": second["time"], "level": "warning", "logger": "kvstore.node", "message": "plain"}


@pytest.mark.parametrize("daemon_logging", ["json"], indirect=True)
def test_json_exceptions_are_a_field_and_odd_fields_still_serialize(daemon_logging: io.StringIO) -> None:
    log = logging.getLogger("kvstore.test")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it failed", extra={"path": object(), "time": "a field named like a key"})
    (line,) = daemon_logging.getvalue().splitlines()
    doc = json.loads(line)
    assert doc["level"] == "error" and doc["message"] == "it failed"
    assert doc["exception"].startswith("Traceback (most recent call last)") and "ValueError: boom" in doc["exception"]
    assert doc["path"].startswith("<object object at")
    assert doc["field_time"] == "a field named like a key" and doc["time"].endswith("Z")


@pytest.mark.parametrize("daemon_logging", ["text"], indirect=True)
def test_text_lines_give_fields_as_key_value(daemon_logging: io.StringIO) -> None:
    log = logging.getLogger("kvstore.node")
    log.info("store open at %s", "/var/lib/kvstore", extra=REPORT)
    log.info("with a spaced field", extra={"why": "two words", "none": None, "ok": True})
    first, second = daemon_logging.getvalue().splitlines()
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO kvstore.node: store open at /var/lib/kvstore ", first)
    assert "index_rebuilt=true segments=3 segments_from_footer=0" in first and "records_replayed=7" in first
    assert 'truncated=[{"segment":"alice/0000000000000001.seg","offset":8192,"bytes":5008}]' in first
    assert 'orphans_removed=["ghost"]' in first and "corrupt=[]" in first
    assert "{'" not in first  # no Python repr
    assert second.endswith('with a spaced field why="two words" none=null ok=true')


@pytest.mark.parametrize("daemon_logging", ["json", "text"], indirect=True)
def test_secrets_are_scrubbed_from_messages_fields_and_tracebacks(daemon_logging: io.StringIO) -> None:
    log = logging.getLogger("kvstore.test")
    log.warning(
        "admin %s",
        ADMIN,
        extra={"header": f"Authorization: Bearer {ADMIN}", "nested": {"keys": [KEY.hex()], "n": 1}, "raw": KEY},
    )
    try:
        raise RuntimeError(f"with key {KEY.hex()}")
    except RuntimeError:
        log.exception("failed", extra={"token": ADMIN})
    text = daemon_logging.getvalue()
    for secret in (ADMIN, KEY.hex(), repr(KEY)[2:-1]):
        assert secret not in text
    assert text.count(REDACTED) >= 6
    if text.startswith("{"):
        first, second = (json.loads(line) for line in text.splitlines())
        assert (
            first["nested"] == {"keys": [REDACTED], "n": 1} and first["raw"] == repr(KEY)[:2] + REDACTED + repr(KEY)[-1]
        )
        assert second["token"] == REDACTED and "RuntimeError: with key " + REDACTED in second["exception"]


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log_format='xml'"):
        logs.formatter("xml")

"""The log scrubber (kvstore/redaction.py): every form a secret can be logged in."""

from __future__ import annotations

import base64
import io
import logging
import os
from collections.abc import Iterator

import pytest

from kvstore.redaction import REDACTED, Scrubber, install

TOKEN = "kvs_" + base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")
ADMIN = "an-admin-token-of-some-length"
KEY = os.urandom(32)


@pytest.fixture
def scrubber() -> Scrubber:
    s = Scrubber()
    s.add_secret(ADMIN)
    s.add_key(KEY)
    return s


@pytest.fixture
def installed(scrubber: Scrubber) -> Iterator[tuple[Scrubber, io.StringIO]]:
    """The scrubber installed process-wide, with a root handler; undone after."""
    factory = logging.getLogRecordFactory()
    root = logging.getLogger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root.addHandler(handler)
    try:
        install(scrubber)
        yield scrubber, stream
    finally:
        logging.setLogRecordFactory(factory)
        root.removeHandler(handler)
        for h in root.handlers:
            h.removeFilter(scrubber)


@pytest.mark.parametrize(
    "text",
    [
        f"b'Authorization: Bearer {TOKEN}\\x01'",
        f"{{'Host': 'x', 'Authorization': 'Bearer {TOKEN}'}}",
        f"<CIMultiDictProxy('Authorization': '{ADMIN}')>",
        f"Got more than 8190 bytes when reading: b'Bearer {TOKEN[:30]}...'",
        f"Bearer\\t{TOKEN}",
        f"bearer%20{ADMIN}",
        f'{{"name": "t", "token": "{TOKEN}", "token_id": "0123456789abcdef"}}',
        f"/v1/x?token={ADMIN}&a=b",
        f"proxy-authorization: Basic {base64.b64encode(b'u:p').decode()}",
        f"key {KEY.hex()} and {KEY.hex().upper()}",
        f"key {base64.b64encode(KEY).decode()} or {base64.urlsafe_b64encode(KEY).decode().rstrip('=')}",
        f"raw {KEY!r}",
        f"just the token {TOKEN} in prose",
        f"admin {ADMIN}.",
    ],
)
def test_secret_forms_are_redacted(scrubber: Scrubber, text: str) -> None:
    out = scrubber.scrub(text)
    assert REDACTED in out
    for secret in (TOKEN, TOKEN[:30], ADMIN, KEY.hex(), base64.b64encode(KEY).decode(), repr(KEY)[2:-1], "dTpw"):
        assert secret not in out, (text, out)
    assert scrubber.scrub(out) == out  # idempotent


@pytest.mark.parametrize(
    "text",
    [
        "unknown or revoked token",
        "admin token required",
        "token_id 0123456789abcdef revoked",
        "PUT /v1/blocks/{key}: body ended after 400 of 1000 bytes",
        "store open at /var/lib/kvstore: {'segments': 3}",
        "store open at /srv/kvs_data01",
    ],
)
def test_ordinary_text_is_left_alone(scrubber: Scrubber, text: str) -> None:
    assert scrubber.scrub(text) == text


def test_short_literals_are_not_registered(scrubber: Scrubber) -> None:
    scrubber.add_secret("abc")
    scrubber.add_secret(None)
    assert scrubber.scrub("abc abc") == "abc abc"


def test_message_args_traceback_and_stack_are_scrubbed(installed: tuple[Scrubber, io.StringIO]) -> None:
    _, stream = installed
    log = logging.getLogger("test.redaction")
    log.warning("token %s and %r", TOKEN, {"Authorization": f"Bearer {ADMIN}"})
    try:
        raise RuntimeError(f"failed with key {KEY.hex()}")
    except RuntimeError:
        log.exception("while using %s", ADMIN)
    log.warning("stack", stack_info=True, extra={"x": 1})
    log.warning("bad format %d", ADMIN)  # formatting fails: still scrubbed, still logged
    text = stream.getvalue()
    assert "RuntimeError" in text and "Stack (most recent call last)" in text and "bad format" in text
    for secret in (TOKEN, ADMIN, KEY.hex()):
        assert secret not in text


def test_handlers_added_later_and_loggers_that_do_not_propagate(installed: tuple[Scrubber, io.StringIO]) -> None:
    later = io.StringIO()
    log = logging.getLogger("test.redaction.isolated")
    log.propagate = False
    handler = logging.StreamHandler(later)
    log.addHandler(handler)
    try:
        log.error("Authorization: Bearer %s", TOKEN)
        log.error("%s", KEY.hex())
    finally:
        log.removeHandler(handler)
    assert later.getvalue().count(REDACTED) == 2 and TOKEN not in later.getvalue()


def test_install_is_idempotent(installed: tuple[Scrubber, io.StringIO]) -> None:
    scrubber, stream = installed
    factory = logging.getLogRecordFactory()
    install(scrubber)
    assert logging.getLogRecordFactory() is factory
    logging.getLogger("test.redaction").warning("%s", ADMIN)
    assert stream.getvalue() == f"{REDACTED}\n"

"""What the admin command reads from its flags and shows a person
(kvstore/admin/values.py, render.py): values as an operator writes them,
numbers in an operator's units, tables aligned."""

from __future__ import annotations

import argparse

import pytest

from kvstore.admin import render
from kvstore.admin.parser import DEFAULT_URL
from kvstore.admin.values import NULL, SIZE, count, json_value, or_null, seconds, size, text_or_null
from kvstore.server_config import DEFAULT_PORT


def test_the_default_url_is_the_daemons_default_address() -> None:
    assert f"http://127.0.0.1:{DEFAULT_PORT}" == DEFAULT_URL


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1073741824", 1 << 30), ("10GiB", 10 << 30), ("512k", 512 << 10), ("4 MiB", 4 << 20), ("0", 0), ("2t", 2 << 40)],
)
def test_sizes(text: str, expected: int) -> None:
    assert size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"), [("3600", 3600), ("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800)]
)
def test_durations(text: str, expected: int) -> None:
    assert seconds(text) == expected


@pytest.mark.parametrize("text", ["-5", "1.5GiB", "ten", "", "5 parsecs"])
def test_a_bad_size_names_what_was_expected_and_what_came(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size in bytes"):
        size(text)
    with pytest.raises(argparse.ArgumentTypeError, match=f"expected a size .*, or none; got {text!r}"):
        or_null(size, SIZE, "none")(text)


def test_none_and_default_are_the_daemons_null() -> None:
    for word in ("none", "default", "NONE", " null "):
        assert or_null(count, "a count", "default")(word) is NULL
        assert text_or_null(word) is NULL
    assert json_value(NULL) is None and json_value(7) == 7 and text_or_null("kv@pod@model") == "kv@pod@model"
    with pytest.raises(argparse.ArgumentTypeError):
        count("-1")


def test_units_for_a_person() -> None:
    assert [render.size(n) for n in (0, 512, 1536, 10 << 30)] == ["0 B", "512 B", "1.5 KiB", "10.0 GiB"]
    assert render.size(None) == "none" and render.size(None, none="the store's") == "the store's"
    assert [render.duration(s) for s in (0, 45, 90, 3600, 43200 + 60, 3 * 86400 + 4 * 3600 + 5)] == [
        "0s",
        "45s",
        "1m30s",
        "1h",
        "12h1m",
        "3d4h",
    ]
    assert render.duration(0.25) == "0.2s" and render.duration(None) == "none"
    assert render.ratio(1, 3) == "25.0%" and render.ratio(0, 0) == "-"
    assert render.count(1234567) == "1,234,567"
    assert render.when(1_700_000_000 * 10**9) == "2023-11-14 22:13:20Z"


def test_tables_align_names_left_and_numbers_right() -> None:
    text = render.table(["NAME", "BLOCKS"], [["a", "1"], ["longer", "1,000"]], numeric=[1])
    assert text.splitlines() == ["NAME    BLOCKS", "a            1", "longer   1,000"]
    assert render.pairs([("a", "1"), ("long name", "x")]).splitlines() == ["a          1", "long name  x"]

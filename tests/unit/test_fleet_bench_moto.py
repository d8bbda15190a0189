"""``kvstore-bench fleet`` needs moto's S3 server: without it (the README's
environment has no test extra) it says, in one line and before anything
starts, which module is missing and the exact command that installs it.

Regression: issue 40's operator met ``ModuleNotFoundError`` from the bench;
moto without its ``server`` extra (no flask) passed the check that only
looked for the ``moto`` package, then failed on the server's import."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
from kvstore_bench import fleet_bench

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_module_is_named_with_the_command_that_installs_it() -> None:
    def no_flask(name: str) -> object:
        raise ModuleNotFoundError("No module named 'flask'", name="flask")

    said = fleet_bench.missing_moto(no_flask)
    assert said == (
        "kvstore-bench fleet: needs moto's S3 server (no module 'flask'); install it with: "
        f"{sys.executable} -m pip install 'moto[server]>=5'"
    )


def test_the_installed_server_is_found() -> None:
    assert fleet_bench.missing_moto() == ""  # the test extra installs it


def test_fleet_exits_2_with_that_line_before_any_daemon_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "moto.server", None)  # (an import of it now fails)
    started: list[object] = []
    monkeypatch.setattr(fleet_bench.Fleet, "start", lambda *a: started.append(a))
    assert fleet_bench.main(["--blocks", "10"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and not started
    assert out.err == (
        "kvstore-bench fleet: needs moto's S3 server (no module 'moto.server'); install it with: "
        f"{sys.executable} -m pip install 'moto[server]>=5'\n"
    )


def test_the_extras_install_what_the_message_names() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert fleet_bench.MOTO in extras["test"] and fleet_bench.MOTO in extras["bench"]

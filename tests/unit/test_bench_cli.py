"""kvstore-bench as the wheel installs it: its own modules, its own samples, a
daemon it finds as ``python -m kvstore``, and a command line that behaves.

Regressions pinned here:

* bench imported its own modules as ``bench.x`` and found its samples and
  the daemon (``server.py``) from the repository root: installed from the
  wheel (package ``kvstore_bench``, no checkout) every subcommand failed;
* ``kvstore-bench size ... | head -2`` ended with a BrokenPipeError traceback;
* ``run --png`` without matplotlib measured for minutes, then failed drawing;
* ``ttft --help`` did not list ``--engine vllm``, most of codec's, nixl's,
  events' and writes' options had no help, and help texts named issue numbers.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import kvstore_bench
import pytest
from kvstore_bench import cli
from kvstore_bench.samples import SAMPLES

BENCH = Path(kvstore_bench.__file__).resolve().parent
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d|#\d+\b", re.IGNORECASE)
# A command line of the console script `kvstore-bench`, whatever the current directory.
BENCH_COMMAND = [sys.executable, "-c", "import sys; from kvstore_bench.cli import main; sys.exit(main())"]


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    parser, _ = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # no public listing
    assert list(sub.choices) == list(cli.COMMANDS)
    helps = {c.dest: c.help for c in sub._choices_actions}
    for name in cli.COMMANDS:
        assert re.search(rf"^\s+{name}\s+\S", out, flags=re.MULTILINE), f"{name} is not listed with its help"
        assert helps[name] and not ISSUE_NUMBER.search(helps[name])


def test_every_option_of_every_subcommand_says_what_it_means() -> None:
    parsers = cli.subcommand_parsers()
    assert set(parsers) == {*cli.COMMANDS, "ttft --engine vllm"}
    for name, parser in parsers.items():
        assert parser.prog == f"kvstore-bench {name}", parser.prog
        for text in (parser.description, parser.epilog):
            assert not (text and ISSUE_NUMBER.search(text)), f"{name}: {text!r}"
        options = _options(parser)
        assert options, name
        for action in options:
            flag = "/".join(action.option_strings)
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {flag} has no help"
            assert len(action.help.split()) >= 3, f"{name} {flag}: {action.help!r} says too little"
            assert not ISSUE_NUMBER.search(action.help), f"{name} {flag}: {action.help!r}"


@pytest.mark.parametrize(
    "name", ["size", "ttft", "run", "codec", "s3", "writes", "qos", "fleet", "events", "nixl", "replay"]
)
def test_every_subcommand_help_prints(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvstore-bench {name}")
    for action in _options(cli.subcommand_parsers()[name]):
        assert action.option_strings[-1] in out


def test_ttft_help_lists_the_measured_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """``ttft --engine vllm`` was handled before the ttft parser, which did not know it."""
    with pytest.raises(SystemExit):
        cli.main(["ttft", "--help"])
    out = capsys.readouterr().out
    assert "--engine {vllm}" in out and "ttft --engine vllm --help" in " ".join(out.split())
    with pytest.raises(SystemExit):
        cli.main(["ttft", "--engine", "vllm", "--help"])
    assert "--engine-python" in capsys.readouterr().out


def test_ttft_refuses_another_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["ttft", "--engine", "sglang"]) == 2
    assert "argument --engine" in capsys.readouterr().err


def test_no_string_in_bench_names_an_issue() -> None:
    """Help texts are built from module docstrings and printed lines from literals:
    none of them may point at a tracker the user has never seen."""
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not ISSUE_NUMBER.search(node.value), f"{path.name}:{node.lineno}: {node.value[:80]!r}"


def _code_lines(path: Path) -> str:
    """``path`` without its docstrings and comments (they may say where a checkout
    keeps things; the code may not look there)."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                for i in range(first.lineno - 1, first.end_lineno or first.lineno):
                    lines[i] = ""
    return "\n".join(line.split(" #")[0] for line in lines if not line.lstrip().startswith("#"))


def test_bench_depends_on_no_checkout() -> None:
    """Each of these found the repository root, which the wheel does not have."""
    checkout = re.compile(r"parents\[1\]|parent\.parent|server\.py|\bROOT\b|\"tests\"|sys\.path\.insert")
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                assert not node.module.startswith("bench"), f"{path.name}: from {node.module} import (not relative)"
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "bench" for a in node.names), path.name
        found = checkout.search(_code_lines(path))
        assert found is None, f"{path.name}: {found}"


def test_samples_ship_in_the_package() -> None:
    assert SAMPLES.is_relative_to(BENCH)
    files = sorted(p.name for p in SAMPLES.glob("*.bin"))
    assert len(files) >= 4 and any(".bf16." in f for f in files) and any(".f16." in f for f in files)
    assert (SAMPLES / "README.md").is_file()


def test_codec_runs_from_outside_the_checkout(tmp_path: Path) -> None:
    """From another directory, as an installed command: its own samples, its own modules."""
    r = subprocess.run(
        [*BENCH_COMMAND, "codec", "--frame-sizes", "256KiB", "--repeats", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for sample in SAMPLES.glob("*.bin"):
        assert sample.name in r.stdout
    assert "zstd-bp2" in r.stdout


def _closed_pipe_run(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    """``argv`` with its stdout a pipe whose reader closed before the first byte (what
    ``| head -2`` does to the rest of the output, every time, not by a race)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([*BENCH_COMMAND, *argv], stdout=w, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(w)


@pytest.mark.parametrize(
    "argv",
    [
        ["size", "--model", "llama-3.1-70b", "--tp", "8", "--context", "131072", "--users", "1000"],
        ["size", "--model", "llama-3.1-8b", "--json"],
        ["ttft", "--model", "llama-3.1-70b", "--throughput-gbps", "10", "--prefill-tps", "20000"],
        ["codec", "--frame-sizes", "256KiB", "--repeats", "1"],
    ],
)
def test_output_cut_short_ends_quietly(argv: list[str]) -> None:
    """It used to end with "BrokenPipeError: [Errno 32] Broken pipe" on stderr."""
    r = _closed_pipe_run(argv)
    assert r.stderr == b""
    assert r.returncode == 141  # 128 + SIGPIPE, as a process SIGPIPE killed


def test_output_cut_short_by_head() -> None:
    r = subprocess.run(
        shlex.join(BENCH_COMMAND) + " size --model llama-3.1-8b --context 4096 | head -2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stderr == ""
    assert len(r.stdout.splitlines()) == 2


_NO_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "  # `import matplotlib` now raises ImportError
    "from kvstore_bench.cli import main; sys.exit(main())"
)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--short", "--png", "out.png"],
        ["run", "--peers", "none", "--png", "out.png", "--json", "out.json"],
        ["ttft", "--engine", "vllm", "--engine-python", sys.executable, "--png", "out.png"],
    ],
)
def test_png_without_matplotlib_fails_before_measuring(argv: list[str], tmp_path: Path) -> None:
    """``run --png`` used to measure (a daemon, minutes of load) and only then fail to import
    matplotlib, with a traceback."""
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", _NO_MATPLOTLIB, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert "argument --png" in r.stderr and "matplotlib" in r.stderr and "pip install matplotlib" in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""  # run prints its data set before it starts anything: nothing started
    assert time.monotonic() - t0 < 30
    assert list(tmp_path.iterdir()) == []

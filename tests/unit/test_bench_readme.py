"""Issue 24, item 9: bench/README.md had no section for `kvstore-bench size`
and `ttft`. Every subcommand of kvstore-bench has one, with a command line
that parses."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from kvstore_bench import ttft_sweep
from kvstore_bench.cli import build_parser

README = Path(__file__).resolve().parents[2] / "bench" / "README.md"


def _subcommands() -> list[str]:
    parser, _ = build_parser()
    choices = next(a.choices for a in parser._actions if a.dest == "command")  # argparse has no public listing
    assert choices is not None
    return sorted(choices)


def test_every_subcommand_has_a_section() -> None:
    text = README.read_text()
    # "## `kvstore-bench NAME`: ...", or the module it runs: "## `NAME_bench`: ..."
    headings = set(re.findall(r"^## `(?:kvstore-bench ([\w-]+)|(\w+)_bench)`", text, flags=re.MULTILINE))
    named = {a or b for a, b in headings}
    missing = [name for name in _subcommands() if name not in named]
    assert not missing, f"bench/README.md has no section for: {missing}"


def test_size_and_ttft_examples_parse() -> None:
    parser, _ = build_parser()
    lines = re.findall(r"^\.venv/bin/kvstore-bench ((?:size|ttft) .*)$", README.read_text(), flags=re.MULTILINE)
    assert len(lines) >= 5, lines
    for line in lines:
        args = shlex.split(line)
        if "--engine" in args:  # the measured sweep (bench/ttft_sweep.py) has its own options
            at = args.index("--engine")
            assert args[at + 1] == "vllm"
            ttft_sweep.parse_args([*args[1:at], *args[at + 2 :], "--engine-python", sys.executable])
        else:
            parser.parse_args(args)

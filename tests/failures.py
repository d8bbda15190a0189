"""Print the failed tests of a pytest JUnit XML report, one short line each.

tests/run.sh and tests/run_engines.sh print them last: CI keeps only the
tail of the output, and pytest's own summary line of a failed comparison
of large values can fill the whole tail without naming the test."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(path: str) -> int:
    failed = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            where = f"{case.get('classname', '')}::{case.get('name', '')}"
            message = " ".join((bad.get("message") or "").split())
            failed.append(f"{bad.tag.upper()} {where}: {message[:160]}")
    print(f"== {len(failed)} failed" + "".join(f"\n{line}" for line in failed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

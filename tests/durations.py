"""The suite's time per test file, from pytest's JUnit XML: a Markdown table, and, given
two reports, before and after side by side.

    PYTEST_ADDOPTS=--junitxml=after.xml bash .ci/run
    python -m tests.durations after.xml                 # one run
    python -m tests.durations before.xml after.xml      # before / after, slowest first
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def per_file(path: str) -> dict[str, tuple[int, float]]:
    """file -> (tests, seconds), from the report's test cases (classname tests.test_x)."""
    tests: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")
        file = next((part for part in name if part.startswith("test_")), ".".join(name)) + ".py"
        tests[file] += 1
        seconds[file] += float(case.get("time", 0))
    return {f: (tests[f], seconds[f]) for f in tests}


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def table(reports: list[dict[str, tuple[int, float]]]) -> str:
    files = sorted(set().union(*reports), key=lambda f: -reports[-1].get(f, (0, 0.0))[1])
    head = "| file | " + " | ".join(["tests", "time"] if len(reports) == 1 else
                                      ["tests before", "before", "tests after", "after"]) + " |"
    lines = [head, "| --- " * (1 + 2 * len(reports)) + "|"]
    for f in [*files, "total"]:
        cells = []
        for report in reports:
            n, s = (sum(v[0] for v in report.values()), sum(v[1] for v in report.values())) if f == "total" \
                else report.get(f, (0, 0.0))
            cells += [str(n), minutes(s)]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if not 2 <= len(sys.argv) <= 3:
        sys.exit(__doc__)
    print(table([per_file(p) for p in sys.argv[1:]]))

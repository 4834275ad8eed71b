"""The order of a parallel run (pytest-xdist, `--dist loadfile`: a worker takes the next whole file when it runs low):
the slowest package first and, within it, its slowest file first, so the run does not end on one worker with a
long file while the other idles; a package's files stay together, so both workers reuse its package fixtures.
Each file's seconds are data (tests/durations.json, from a run's junit file: `python -m tests.schedule JUNIT`);
a file missing there counts as instant."""
from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DURATIONS = os.path.join(ROOT, "tests", "durations.json")


def file_seconds(junit_path: str) -> dict[str, float]:
    """{test file (repository-relative): the sum of its tests' times, set-up and teardown included}."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit_path).iter("testcase"):
        seconds[case.get("classname").replace(".", "/") + ".py"] += float(case.get("time") or 0)
    return {f: round(s, 1) for f, s in sorted(seconds.items())}


def slowest_first(items: list, root: str = ROOT) -> list:
    """`items` by package time, then file time (both descending); the collection order otherwise."""
    try:
        with open(DURATIONS) as f:
            seconds = json.load(f)
    except FileNotFoundError:
        return items
    rel = {str(i.path): os.path.relpath(str(i.path), root) for i in items}
    package: Counter[str] = Counter()
    for path in set(rel.values()):
        package[os.path.dirname(path)] += seconds.get(path, 0.0)
    order = {id(item): n for n, item in enumerate(items)}
    return sorted(items, key=lambda i: (-package[os.path.dirname(rel[str(i.path)])],
                                        -seconds.get(rel[str(i.path)], 0.0), order[id(i)]))


if __name__ == "__main__":
    with open(DURATIONS, "w") as out:
        json.dump(file_seconds(sys.argv[1]), out, indent=0)
        out.write("\n")

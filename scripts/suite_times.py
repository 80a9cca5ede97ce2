"""Where the suite's time goes: seconds per test module from pytest's `--junitxml` report
(fixtures' setup and teardown included), largest first, and the servers each module started.

    python -m pytest tests --junitxml=junit.xml --basetemp=/tmp/suite
    python scripts/suite_times.py junit.xml --basetemp /tmp/suite

Every server start leaves one `serve.log` in its work directory below pytest's base directory,
so `--basetemp` also counts the run's server starts.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path


def per_module(junit: Path) -> dict[str, tuple[float, int]]:
    """module -> (seconds, tests), largest first."""
    seconds: dict[str, float] = defaultdict(float)
    tests: Counter = Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "?").split(".")[-1]
        seconds[module] += float(case.get("time", 0))
        tests[module] += 1
    return {m: (seconds[m], tests[m]) for m in sorted(seconds, key=lambda m: -seconds[m])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--basetemp", type=Path, help="pytest's --basetemp of the same run: count its server starts")
    args = parser.parse_args()
    modules = per_module(args.junit)
    total = sum(seconds for seconds, _ in modules.values())
    print(f"{'module':32} {'s':>7} {'%':>5} {'tests':>5}")
    for module, (seconds, count) in modules.items():
        print(f"{module:32} {seconds:7.0f} {100 * seconds / total:5.1f} {count:5d}")
    print(f"{'total':32} {total:7.0f}")
    if args.basetemp:
        print(f"server starts: {sum(1 for _ in args.basetemp.rglob('serve.log'))}")


if __name__ == "__main__":
    main()

"""Where the suite's time goes: seconds per test module from pytest's `--junitxml` report
(fixtures' setup and teardown included), largest first, and the servers each module started.

    python -m pytest tests --junitxml=junit.xml --basetemp=/tmp/suite
    python scripts/suite_times.py junit.xml --basetemp /tmp/suite

Every server start leaves one `serve.log` in its work directory below pytest's base directory,
so `--basetemp` also counts the run's server starts.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path


def seconds_per_module(junit: Path) -> dict[str, float]:
    per_module: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1] if case.get("classname") else "?"
        per_module[module.split(".")[0]] += float(case.get("time", 0))
    return dict(sorted(per_module.items(), key=lambda kv: -kv[1]))


def server_starts(basetemp: Path) -> int:
    return sum(1 for _ in basetemp.rglob("serve.log"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--basetemp", type=Path, help="pytest's --basetemp of the same run: count its server starts")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    modules = seconds_per_module(args.junit)
    total = sum(modules.values())
    tests = Counter(c.get("classname", "?") for c in ET.parse(args.junit).getroot().iter("testcase"))
    print(f"{'module':32} {'s':>7} {'%':>5} {'tests':>5}")
    for module, seconds in modules.items():
        count = sum(n for name, n in tests.items() if name.split(".")[-1] == module)
        print(f"{module:32} {seconds:7.0f} {100 * seconds / total:5.1f} {count:5d}")
    print(f"{'total':32} {total:7.0f}")
    starts = server_starts(args.basetemp) if args.basetemp else None
    if starts is not None:
        print(f"server starts: {starts}")
    if args.json:
        args.json.write_text(json.dumps({"seconds_per_module": modules, "total_s": total, "server_starts": starts}, indent=1))


if __name__ == "__main__":
    main()

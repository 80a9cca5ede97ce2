"""What every result file starts with: which benchmark, when, at which commit, by which command, on which machine."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_record(benchmark: str) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {
        "benchmark": benchmark,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or None,
        "command": " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(), "python": platform.python_version()},
    }

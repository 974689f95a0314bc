"""Where every bench writes its numbers: bench/results/NAME.json, with when, where and on which
commit they were measured. The README's and the docs' numbers are read from these files, never typed in."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def current_commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=RESULTS.parent, capture_output=True, text=True)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of a file another process may still be writing ([] when absent)."""
    if not path.exists():
        return []
    complete = path.read_bytes()
    complete = complete[: complete.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.decode().splitlines() if line.strip()]


def utc_now() -> str:
    """The time a result is measured at, as every record of bench/results says it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_result(name: str, result: dict[str, Any]) -> Path:
    """Writes bench/results/{name}.json: `result` under "result", beside how it was measured."""
    RESULTS.mkdir(exist_ok=True)
    record = {
        "bench": name,
        "measured_at": utc_now(),
        "commit": current_commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "result": result,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results written to {path}")
    return path


# Two-sided 95% quantiles of Student's t, by degrees of freedom (1.96 beyond the table).
T_975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def interval(ratios: list[float]) -> dict[str, float] | None:
    """The geometric mean of per-round ratios with its 95% confidence interval (t on the logs):
    rounds are the repeated measurements, so the interval is what this run can tell apart."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = (
        (T_975[len(logs) - 2] if len(logs) - 1 <= len(T_975) else 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    )
    return {
        "mean": round(math.exp(mean), 3),
        "low": round(math.exp(mean - half), 3),
        "high": round(math.exp(mean + half), 3),
    }

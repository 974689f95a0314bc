"""Where every bench writes its numbers: bench/results/NAME.json, with when, where and on which
commit they were measured. The README's numbers are read from these files, never typed in."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=RESULTS.parent, capture_output=True, text=True)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def write_result(name: str, result: dict[str, Any]) -> Path:
    """Writes bench/results/{name}.json: `result` under "result", beside how it was measured."""
    RESULTS.mkdir(exist_ok=True)
    record = {
        "bench": name,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "result": result,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results written to {path}")
    return path

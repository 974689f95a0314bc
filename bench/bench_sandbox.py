"""A trivial program (`print(1)`) run in the sandbox vs a bare `python -c` subprocess: what isolation costs.

    python -m bench.bench_sandbox [--rounds 8] [--runs 10]

Each round launches every side --runs times, the sides taking turns (their order rotates by round):
- sandbox: environments.sandbox.run_python("print(1)") at the strongest level this machine has,
  the whole call (work directory, program file, limits, isolation, output files, cleanup);
- each other available level the same way, for the table of levels;
- bare: subprocess.run([python, "-I", "-c", "print(1)"], capture_output=True), the same interpreter;
- bare_again: bare once more, the control.
Reported: mean wall seconds per launch per side and round, the ratio sandbox / bare per round with
its 95% interval over rounds, and control / bare. Written to bench/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from bench.results import interval, write_result
from environments.sandbox import INTERPRETER, LEVELS, available, isolation, run_python

REPO = Path(__file__).resolve().parents[1]


def launch(side: str) -> None:
    if side.startswith("bare"):
        done = subprocess.run([INTERPRETER, "-I", "-c", "print(1)"], capture_output=True, text=True)
        output = done.stdout
    else:
        result = run_python("print(1)", level=side)
        output = result.stdout
    if output != "1\n":
        raise RuntimeError(f"{side}: print(1) printed {output!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--runs", type=int, default=10, help="launches per side per round")
    args = parser.parse_args()
    strongest = isolation()
    sides = (
        [strongest] + [level for level in LEVELS if level != strongest and available(level)] + ["bare", "bare_again"]
    )
    for side in sides:  # warm the page cache and the probes before timing
        launch(side)
    rounds = []
    for index in range(args.rounds):
        order = sides[index % len(sides) :] + sides[: index % len(sides)]
        measured = {}
        for side in order:
            started = time.perf_counter()
            for _ in range(args.runs):
                launch(side)
            measured[side] = (time.perf_counter() - started) / args.runs
        rounds.append(measured)
        print(
            json.dumps({side: round(seconds * 1e3, 1) for side, seconds in measured.items()}),
            "ms per launch",
            flush=True,
        )
    ratios = [r[strongest] / r["bare"] for r in rounds]
    control = [r["bare_again"] / r["bare"] for r in rounds]
    result = {
        "program": "print(1)",
        "isolation": strongest,
        "runs_per_round": args.runs,
        "rounds": rounds,
        "mean_s": {side: round(statistics.fmean(r[side] for r in rounds), 5) for side in sides},
        "ratio_sandbox_to_bare": round(statistics.fmean(ratios), 3),
        "ratio_interval": interval(ratios),
        "ratio_control": round(statistics.fmean(control), 3),
        "ratio_by_level": {
            level: round(statistics.fmean(r[level] / r["bare"] for r in rounds), 3) for level in sides[:-2]
        },
    }
    print(json.dumps({key: value for key, value in result.items() if key != "rounds"}, indent=1))
    write_result("sandbox", result)


if __name__ == "__main__":
    main()

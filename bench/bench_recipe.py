"""A real model learns: the real-model recipe (runs/smollm2-times-tables.yaml) as `clotho run`, one run per seed.

    python -m bench.bench_recipe [--config runs/smollm2-times-tables.yaml] [--seeds 0,1,2]
        [--gain 0.30] [--minutes 30] [--result recipe]

Each seed is a first run of the recipe from the instruct model (`clotho model get`, cached), with the
seed set for the environment's item stream and the trainer; the pipeline evaluates greedy answers to
the held-out problems every few versions. Per seed: the held-out curve (reward, minutes, how long
each evaluation took to answer), the start (version 0, the model's own), the best, the end, the
minutes until the curve first stood `gain` above the start, seconds per step, the run's storage at
the end and a few sampled completions of the first and the last group stored. The recipe's target
(issue 67): +0.30 over the start within 30 minutes on 2 cores, in every seed. Written to
bench/results/recipe.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.results import read_jsonl, write_result

REPO = Path(__file__).resolve().parents[1]

CLOTHO = str(REPO / ".venv" / "bin" / "clotho")
MODEL_NAME = "smollm2-135m-instruct"


def seed_settings(seed: int) -> list[str]:
    """--set values that seed a run: every environment's item stream of every phase, and the trainer."""
    return [f"trainer.seed={seed}", f"phases.0.environments.0.config.seed={seed}"]


def minutes_to(curve: list[dict], target: float) -> float | None:
    """Minutes since the pipeline started until the held-out reward first reached `target`."""
    return next((row["minutes"] for row in curve if row["reward"] >= target - 1e-9), None)


def one_seed(config: Path, model: Path, seed: int, workdir: Path, gain: float, minutes: float) -> dict:
    workdir.mkdir(parents=True)
    run = workdir / "store" / "run"
    log = workdir / "run.log"
    settings = [f"run={json.dumps(str(run))}", f"model={json.dumps(str(model))}", *seed_settings(seed)]
    command = [CLOTHO, "run", str(config), *(arg for s in settings for arg in ("--set", s))]
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wall_minutes = (time.monotonic() - started) / 60
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: clotho run exited {done.returncode}; see {log}:\n{log.read_text()[-3000:]}")
    summary = json.loads((run / "trainer" / "summary.json").read_text())
    curve = summary.get("curve", [])
    start = curve[0]["reward"] if curve and curve[0]["step"] == 0 else None
    if start is None:
        raise SystemExit(f"seed {seed}: no evaluation of version 0 in {run}/trainer/summary.json")
    steps = read_jsonl(run / "trainer" / "metrics.jsonl")
    reached = minutes_to(curve, start + gain)
    print(
        f"seed {seed}: held-out {start:.3f} -> best {max(r['reward'] for r in curve):.3f} -> end {curve[-1]['reward']:.3f}; "
        f"+{gain:.2f} reached after {reached if reached is None else round(reached, 1)} min; {wall_minutes:.1f} min in all",
        flush=True,
    )
    return {
        "seed": seed,
        "start": start,
        "best": max(row["reward"] for row in curve),
        "end": curve[-1]["reward"],
        "minutes_to_gain": reached,
        "met": reached is not None and reached <= minutes,
        "steps": summary["steps"],
        "minutes": summary["minutes"],
        "command_minutes": round(wall_minutes, 2),
        "seconds_per_step": round(statistics.median(r["step_time_s"] for r in steps if "step_time_s" in r), 2),
        "evaluation_s_median": round(statistics.median(r["seconds"] for r in curve if "seconds" in r), 2),
        "evaluation_items": curve[-1].get("items"),
        "reload_s_median": summary.get("reload_s_median"),
        "storage": summary.get("storage"),
        "curve": [
            {k: row[k] for k in ("step", "reward", "train_reward", "minutes", "seconds") if k in row} for row in curve
        ],
        "completions": summary.get("completions"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "runs" / "smollm2-times-tables.yaml"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--gain", type=float, default=0.30)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--result", default="recipe")
    parser.add_argument("--model-dir", default=str(REPO / ".clotho" / "models" / MODEL_NAME))
    args = parser.parse_args()
    model = Path(args.model_dir)
    subprocess.run([CLOTHO, "model", "get", MODEL_NAME, str(model)], cwd=REPO, check=True)  # cached after the first
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    root = Path(tempfile.mkdtemp(prefix="clotho-recipe-"))
    try:
        for seed in seeds:
            runs.append(one_seed(Path(args.config), model, seed, root / f"seed-{seed}", args.gain, args.minutes))
            shutil.rmtree(root / f"seed-{seed}" / "store", ignore_errors=True)  # 2-3 GB of checkpoints each
    finally:
        shutil.rmtree(root, ignore_errors=True)
    met = sum(run["met"] for run in runs)
    print(f"{met} of {len(runs)} seeds rose +{args.gain:.2f} within {args.minutes:.0f} minutes", flush=True)
    write_result(
        args.result,
        {
            "config": str(Path(args.config).resolve().relative_to(REPO)),
            "model": MODEL_NAME,
            "gain": args.gain,
            "minutes": args.minutes,
            "seeds_met": met,
            "seeds": len(runs),
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()

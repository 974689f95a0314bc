"""`make soak`: fault injection into a running loop, every fault `--trials` times, then the table.

    python -m soak.run [--trials 20] [--fault rollout --fault trainer ...] [--seed 0] [--work .clotho/soak]
                       [--storage s3]

Starts a tiny model's vLLM server and a Prefect server (shared by every fault's loop), then per
fault a loop (soak.loop) and its trials (soak.faults); then the storage faults, randomized trials of
writers and readers against a moto S3 server behind a fault proxy (soak.storage_faults).
The loops write their runs to a local directory, or with `--storage s3` to a moto S3 server of
their own (every part then reads and writes the run through the S3 API, as on a cluster).
Prints one row per fault (trials, committed groups, lost, trained twice, torn, infra failures
scored as rewards, result) and the measurements behind it, and writes them to `WORK/results.json`.
Exit code 1 when a trial failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from inference.server import free_port
from soak import checks
from soak.faults import FAULTS, run_trials
from soak.loop import Loop, Settings, Trial
from soak.parts import PolicyPart, PrefectPart

STORAGE = "storage (S3 API)"  # no loop: writers and readers against a faulty S3 server
# The --fault names of the faults (soak.faults.FAULTS, and STORAGE).
CHOICES = {
    "rollout": "rollout flow",
    "trainer": "trainer",
    "watcher": "reload watcher",
    "vllm": "vLLM server",
    "prefect": "Prefect server",
    "reload-pause": "paused reload",
    "cpu-hog": "CPU hog in the sandbox",
    "judge-hang": "hanging judge",
    "storage": STORAGE,
}
assert sorted(CHOICES.values()) == sorted([*FAULTS, STORAGE])
# Per fault: how its loop samples. The vLLM fault samples real completions, so requests are in
# flight when the server dies; the others draw them (inference is not what they test).
SETTINGS = {
    "rollout flow": Settings(delay_s=0.5),
    "trainer": Settings(delay_s=0.5),
    "reload watcher": Settings(delay_s=0.5),
    "vLLM server": Settings(delay_s=0.0, sample_tokens=4),
    "Prefect server": Settings(delay_s=0.5),
    # Short reload calls, so a server stopped past them is given up and restored within seconds.
    "paused reload": Settings(delay_s=0.5, reload_step_timeout_s=3.0),
    # Groups scored by code_exec's sandbox and llm_judge's judge (soak.graded): the scoring takes the time.
    "CPU hog in the sandbox": Settings(delay_s=0.0, grader="sandbox"),
    "hanging judge": Settings(delay_s=0.0, grader="judge", judge_timeout_s=1.0),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="Trials per fault (>= 1).")
    parser.add_argument(
        "--fault", action="append", choices=list(CHOICES), help="Only this fault (repeatable); default all."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the kill moments.")
    parser.add_argument("--work", type=Path, default=Path(".clotho/soak"), help="Where runs, logs and results go.")
    parser.add_argument(
        "--storage",
        choices=["file", "s3"],
        default="file",
        help="Where the loops' runs are stored: a local directory, or a moto S3 server started for the soak.",
    )
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials {args.trials}: use 1 or more")
    chosen = [CHOICES[name] for name in args.fault or CHOICES]
    faults = [fault for fault in chosen if fault != STORAGE]
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)

    say(f"soak: {args.trials} trials of {', '.join(chosen)}; runs on {args.storage}; work in {work}")
    started = time.monotonic()
    with loop_storage(args.storage) as storage_root:
        results, replays = run_loop_faults(faults, args.trials, rng, work, storage_root) if faults else ({}, {})
    storage: list[dict] = []
    if STORAGE in chosen:
        from soak.storage_faults import run_storage_fault_soak

        say(f"{STORAGE}: {args.trials} trials")
        storage = run_storage_fault_soak(args.trials, rng.randrange(10**6), report=lambda row: say(f"  {row}"))
    report = render(results, replays, time.monotonic() - started, storage, args.storage)
    print(report)
    (work / "results.json").write_text(
        json.dumps(
            {
                "trials": {fault: [asdict(t) for t in trials] for fault, trials in results.items()},
                "replays": replays,
                "storage": storage,
                "runs_on": args.storage,
            },
            indent=1,
        )
    )
    ok = all(passed(trials, replays.get(fault)) for fault, trials in results.items())
    return 0 if ok and all(row["result"] == "ok" for row in storage) else 1


@contextlib.contextmanager
def loop_storage(kind: str) -> Iterator[str | None]:
    """The root URL the loops' runs go to: None (a directory in each loop's work) for "file"; for
    "s3" a bucket on a moto server started here, its endpoint and credentials in the environment
    every part inherits."""
    if kind == "file":
        yield None
        return
    from clotho.testing.s3_server import s3_bucket

    with s3_bucket("clotho-soak") as server:
        say(f"S3 API server (moto) at {server.endpoint_url}; its request log {server.log_path}")
        yield "s3://clotho-soak"


def run_loop_faults(
    faults: list[str], trials: int, rng: random.Random, work: Path, storage: str | None = None
) -> tuple[dict[str, list[Trial]], dict[str, dict]]:
    """Each fault's trials in a loop of its own, over one vLLM and one Prefect server; the trials
    and each loop's replay against an uninterrupted run."""
    from inference.tiny_model import build_tiny_model

    model = work / "model"
    if not (model / "model.safetensors").exists():
        build_tiny_model(model, seed=0)
    prefect = PrefectPart(work / "prefect", free_port())
    policy = PolicyPart(model, free_port(), work / "logs" / "vllm.log")
    results: dict[str, list[Trial]] = {}
    replays: dict[str, dict] = {}
    try:
        prefect.start()
        say(f"Prefect server up at {prefect.api_url}; starting vLLM (about a minute on 2 cores)")
        policy.start()
        say(f"vLLM up at {policy.base_url}")
        for index, fault in enumerate(faults):
            loop = Loop(
                work / slug(fault),
                model,
                policy.base_url,
                settings=SETTINGS[fault],
                prefect=prefect,
                policy=policy,
                seed=index,
                storage=storage,
            )
            say(f"{fault}: {trials} trials")
            try:
                loop.start()
                results[fault] = run_trials(loop, fault, trials, rng, log=say)
                comparisons = loop.replay(results[fault])
                replays[fault] = {
                    "steps": len(comparisons),
                    "bitwise_equal_steps": sum(c.equal for c in comparisons),
                    "same_groups_steps": sum(c.same_groups for c in comparisons),
                    "max_difference": max((c.max_difference for c in comparisons), default=0.0),
                    "flow_runs": checks.flow_run_states(prefect.api_url, loop.run_url),
                    # What killed parts left behind: clotho's temporary files, checkpoints still staged.
                    "temporary_left": sorted(
                        [path.name for path in (loop.work / "tmp").glob("clotho-*")]
                        + [f"staging/{path.name}" for path in loop.staging_dir.glob("*")]
                    ),
                }
                say(f"{fault}: replay {replays[fault]}")
            finally:
                loop.stop()
    finally:
        policy.stop()
        prefect.stop()
    return results, replays


def passed(trials: list[Trial], replay: dict | None) -> bool:
    """Every trial's checks held, and the replay matched every step (segments without a kill too)."""
    whole = replay is not None and replay["bitwise_equal_steps"] == replay["same_groups_steps"] == replay["steps"]
    return whole and all(t.ok for t in trials)


def slug(fault: str) -> str:
    return fault.lower().replace(" ", "-")


def table_row(fault: str, trials: list[dict], ok: bool) -> str:
    """One fault's row of the table: its trials' counts summed."""
    keys = ("committed", "lost", "twice", "torn", "misscored")  # a row without scores to check (storage) shows "-"
    counts = " | ".join(str(sum(t[key] for t in trials)) if all(key in t for t in trials) else "-" for key in keys)
    return f"| {fault} | {len(trials)} | {counts} | {'pass' if ok else 'FAIL'} |"


def render(
    results: dict[str, list[Trial]],
    replays: dict[str, dict],
    seconds: float,
    storage: list[dict] = (),
    runs_on: str = "file",
) -> str:
    """The table, one row per fault, and the measurements under it."""
    lines = [
        "",
        f"Runs stored on {'a moto S3 server (S3 API)' if runs_on == 's3' else 'local disk'}.",
        "",
        "| fault | trials | committed groups | lost | trained twice | torn | infra failures scored as rewards | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fault, trials in results.items():
        lines.append(table_row(fault, [asdict(t) for t in trials], passed(trials, replays.get(fault))))
    if storage:
        lines.append(table_row(STORAGE, storage, all(row["result"] == "ok" for row in storage)))
    lines.append("")
    for fault, trials in results.items():
        landed: dict[str, int] = {}
        for trial in trials:
            landed[trial.landed] = landed.get(trial.landed, 0) + 1
        per_trial = statistics.mean(t.seconds for t in trials)
        notes = [
            f"{per_trial:.0f} s per trial",
            "kills: " + ", ".join(f"{where} {count}" for where, count in sorted(landed.items())),
        ]
        uncommitted = [t.uncommitted for t in trials if t.uncommitted is not None]
        if uncommitted:
            oldest = max(t.uncommitted_oldest_s or 0.0 for t in trials)
            notes.append(
                f"finished but uncommitted at the kill: {sum(uncommitted)} groups in all, at most {max(uncommitted)} per kill, "
                f"the oldest {oldest:.1f} s old"
            )
        mid_flush = [t for t in trials if "mid-flush" in t.landed]
        if mid_flush:
            notes.append(
                f"{len(mid_flush)} kills left a shard's index entry without its shard: the trainer waited for it "
                f"(storage.index.GRACE_S), those trials took {', '.join(f'{t.seconds:.0f}' for t in mid_flush)} s"
            )
        if SETTINGS[fault].grader:
            notes.append(
                f"groups failed as infra {sum(t.infra_failed for t in trials)}, retries of a {SETTINGS[fault].grader} "
                f"call {sum(t.infra_retries for t in trials)}"
            )
        caught_up = [t.caught_up_s for t in trials if t.caught_up_s is not None]
        if caught_up:
            notes.append(
                f"kill to newest version served: median {statistics.median(caught_up):.0f} s, max {max(caught_up):.0f} s"
            )
        if fault in replays:
            replay = replays[fault]
            notes.append(
                f"replay: {replay['bitwise_equal_steps']}/{replay['steps']} steps bit-identical weights, "
                f"{replay['same_groups_steps']}/{replay['steps']} the same groups (max |diff| {replay['max_difference']:.3g})"
            )
            shown = ", ".join(f"{state.lower()} {count}" for state, count in sorted(replay["flow_runs"].items()))
            notes.append(f"rollout flow runs in the Prefect UI: {shown}")
            if replay["temporary_left"]:
                notes.append(
                    f"left in the parts' TMPDIR: {len(replay['temporary_left'])} ({', '.join(replay['temporary_left'][:3])})"
                )
        failed = [t for t in trials if not t.ok]
        if failed:
            notes.append("failed: " + " | ".join(f"#{t.trial}: {'; '.join(t.problems)}" for t in failed))
        lines.append(f"- {fault}: " + "; ".join(notes))
    if storage:
        per_trial = statistics.mean(row["seconds"] for row in storage)
        failed = [str(row["seed"]) for row in storage if row["result"] != "ok"]
        lines.append(
            f"- {STORAGE}: {per_trial:.0f} s per trial; faults armed {sum(r['armed'] for r in storage)}, requests hit "
            f"{sum(r['fired'] for r in storage)}; {sum(r['checkpoints'] for r in storage)} checkpoints verified against "
            f"their STABLE" + (f"; failed seeds: {', '.join(failed)}" if failed else "")
        )
    lines.append(f"- total {seconds / 60:.1f} min")
    return "\n".join(lines)


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

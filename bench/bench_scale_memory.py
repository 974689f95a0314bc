"""What a trainer step costs in memory at each model size, before and after the cuts that grow with it.

Each case is one child process running the trainer's own optimizer step (trainer.train.optimizer_step
on a DeepSpeed engine built from a TrainerConfig) on micro-batches of `tokens` tokens (sequences of
512: 128 prompt tokens, 384 trained), from a model of the shape `clotho model tiny --size` builds.
It reports the process's peak RSS over the steps (VmHWM, reset after setup), the RSS after the last
step (weights, gradients and AdamW's state, what the step keeps) and seconds a step.

logprobs: `whole` is the trainer before the cut (the model's [rows, L, vocab] logits, then
token_logprobs over all of them: the logits, their fp32 copy and the log-softmax's); `chunked` is
the trainer as it is (hidden states, LM head in chunks of at most LOGIT_CHUNK_BYTES of logits,
recomputed in the backward). checkpointing: transformers' gradient checkpointing on the decoder
layers (TrainerConfig.gradient_checkpointing).

Usage: python -m bench.bench_scale_memory [--sizes smollm2-135m,qwen2.5-0.5b] [--tokens 4096]
       [--dtype float32] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import RESULTS, current_commit, write_result

ROOT = Path(__file__).resolve().parents[1]

MODELS = ROOT / ".clotho" / "bench" / "models"
SEQUENCE = 512
PROMPT = 128
CASES = [("whole", False), ("chunked", False), ("chunked", True)]
SIZES = ["tiny", "small", "smollm2-135m", "qwen2.5-0.5b"]
RESULT = RESULTS / "scale_memory.json"


def model_dir(size: str) -> Path:
    """The `size` model (clotho model tiny --size), built once into .clotho/bench/models."""
    from inference.tiny_model import build_tiny_model

    out = MODELS / size
    if not (out / "config.json").exists():
        build_tiny_model(out, size=size)
    return out


def resident(field: str) -> int:
    """A /proc/self/status memory field (VmHWM, VmRSS) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def whole_logits_logprobs(model, batch, device="cpu"):
    """The trainer's packed_logprobs before the cut: the whole [rows, L, vocab] logits, then
    token_logprobs over them (no entropy)."""
    import torch

    from trainer.model import token_logprobs

    input_ids = batch.input_ids.to(device)
    temperature = 1.0 if batch.temperatures is None else batch.temperatures
    inputs, predictors = dict(input_ids=input_ids, use_cache=False), None
    if batch.needs_mask():
        inputs.update(position_ids=batch.position_ids.to(device), attention_mask=batch.attention_mask().to(device))
        predictors = batch.predictors.to(device) if batch.predictors is not None else None
    elif batch.shares_rows():  # as packed_logprobs: variable-length attention over the sequences' bounds
        bounds, longest = batch.sequence_bounds()
        inputs.update(
            position_ids=batch.position_ids.to(device),
            cu_seq_lens_q=bounds,
            cu_seq_lens_k=bounds,
            max_length_q=longest,
            max_length_k=longest,
        )
    logprobs = token_logprobs(model(**inputs).logits, input_ids, temperature, predictors=predictors)
    return logprobs, torch.zeros_like(logprobs.detach())


def probe(model: str, tokens: int, logprobs: str, checkpointing: bool, dtype: str, steps: int) -> dict:
    """One case in this process: `steps` optimizer steps of `tokens`-token micro-batches."""
    import torch

    import trainer.model
    from core.scored_group import ScoredGroup, ScoredSequence
    from trainer.config import TrainerConfig
    from trainer.distributed import build_engine, init_distributed
    from trainer.step import build_step
    from trainer.train import optimizer_step

    rank, world_size = init_distributed()
    per_step = max(1, tokens // SEQUENCE)
    config = TrainerConfig(
        model=model,
        lr=1e-6,
        groups_per_step=per_step,
        micro_batch_tokens=tokens,
        dtype=dtype,
        gradient_checkpointing=checkpointing,
        share_prompts=False,
    )
    policy = trainer.model.load_policy(model, dtype)
    if checkpointing:
        trainer.model.enable_gradient_checkpointing(policy)
    engine = build_engine(policy, config, world_size)
    if logprobs == "whole":
        trainer.model.packed_logprobs = whole_logits_logprobs
    rng = random.Random(0)

    def group() -> ScoredGroup:
        prompt = [rng.randrange(3, 512) for _ in range(PROMPT)]
        completion = [rng.randrange(3, 512) for _ in range(SEQUENCE - PROMPT)]
        sequence = ScoredSequence(
            tokens=prompt + completion,
            mask=[False] * PROMPT + [True] * len(completion),
            logprobs=[0.0] * PROMPT + [-6.0] * len(completion),
            score=rng.random(),
        )
        other = ScoredSequence(
            tokens=sequence.tokens, mask=sequence.mask, logprobs=sequence.logprobs, score=rng.random()
        )
        return ScoredGroup(env="bench", item_id=str(rng.random()), sequences=[sequence, other])

    batches = [
        build_step(
            [group() for _ in range(per_step // 2 or 1)],
            policy_version=0,
            token_budget=tokens,
            advantage_config=config.advantages,
            share_prompts=False,
        )
        for _ in range(steps)
    ]
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: the steps, not loading
    seconds = []
    for batch in batches:
        started = time.perf_counter()
        optimizer_step(engine, batch, config, rank=rank, world_size=world_size)
        seconds.append(time.perf_counter() - started)
    parameters = sum(p.numel() for p in policy.parameters())
    return {
        "parameters": parameters,
        "tokens": sum(b.stats["tokens"] for b in batches) / len(batches),
        "micro_batches": len(batches[0].micro_batches),
        "peak_rss": resident("VmHWM"),
        "rss_after": resident("VmRSS"),
        "step_seconds": seconds,
        "threads": torch.get_num_threads(),
    }


def run_case(
    size: str, tokens: int, logprobs: str, checkpointing: bool, dtype: str, steps: int, limit: float, max_rss: float
) -> dict:
    """One case in a child process (its own peak), or why it did not finish: killed past `limit`
    seconds or `max_rss` bytes of RSS (the machine's memory is the session's)."""
    command = [
        sys.executable,
        "-m",
        "bench.bench_scale_memory",
        "--probe",
        str(model_dir(size)),
        "--tokens",
        str(tokens),
        "--logprobs",
        logprobs,
        "--dtype",
        dtype,
        "--steps",
        str(steps),
    ] + (["--checkpointing"] if checkpointing else [])
    env = dict(os.environ)
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen(command, stdout=out, stderr=log, text=True, env=env, cwd=ROOT)
        started, error = time.monotonic(), None
        while child.poll() is None:
            time.sleep(0.2)
            try:
                rss = int(Path(f"/proc/{child.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError):
                continue
            if rss > max_rss or time.monotonic() - started > limit:
                error = f"over {max_rss / 2**30:.0f} GiB of RSS" if rss > max_rss else f"over {limit:.0f} s"
                child.kill()
                child.wait()
        if error:
            return {"error": error}
        if child.returncode:
            log.seek(0)
            return {"error": f"exit {child.returncode}: {log.read()[-400:]}"}
        out.seek(0)
        return json.loads(out.read().strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="small,smollm2-135m,qwen2.5-0.5b",
        help="Sizes to run; the result keeps an earlier run's cases of the others (same tokens, dtype).",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="micro_batch_tokens (the trainer's default: 4096).")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--limit", type=float, default=1200.0, help="Seconds a case may take.")
    parser.add_argument("--max-rss-gib", type=float, default=18.0, help="Kill a case past this much RSS.")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--logprobs", default="chunked", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, args.tokens, args.logprobs, args.checkpointing, args.dtype, args.steps)))
        return

    from inference.tiny_model import SHAPES

    cases = []
    for size in args.sizes.split(","):
        vocab = SHAPES[size].get("vocab_size", 512)
        for logprobs, checkpointing in CASES:
            case = run_case(
                size, args.tokens, logprobs, checkpointing, args.dtype, args.steps, args.limit, args.max_rss_gib * 2**30
            )
            case.update(
                size=size,
                vocab=vocab,
                logprobs=logprobs,
                checkpointing=checkpointing,
                tokens_budget=args.tokens,
                dtype=args.dtype,
                commit=current_commit(),
            )
            if "error" not in case:
                # Weights, gradients and AdamW's two moments, fp32: what the step must hold anyway.
                state = 16 * case["parameters"]
                case["state_bytes"] = state
                case["over_state"] = round(case["peak_rss"] / state - 1, 3)
                case["logits_bytes"] = 4 * vocab * args.tokens  # one fp32 copy of the whole logits
                case["step_seconds"] = [round(s, 2) for s in case["step_seconds"]]
            cases.append(case)
            shown = case.get("error") or (
                f"peak {case['peak_rss'] / 2**30:6.2f} GiB (state {case['state_bytes'] / 2**30:5.2f} GiB, "
                f"+{case['over_state']:.0%}), after {case['rss_after'] / 2**30:5.2f} GiB, steps {case['step_seconds']} s"
            )
            print(f"{size:14s} {logprobs:8s} checkpointing={checkpointing!s:5s} {shown}", flush=True)
    # Cases of sizes not run this time stay as an earlier run measured them (each names its commit).
    earlier = json.loads(RESULT.read_text())["result"]["cases"] if RESULT.exists() else []
    ran = {(case["size"], case["logprobs"], case["checkpointing"]) for case in cases}
    kept = [
        case
        for case in earlier
        if (case["size"], case["logprobs"], case["checkpointing"]) not in ran
        and case.get("tokens_budget") == args.tokens
        and case.get("dtype") == args.dtype
    ]
    cases = sorted(
        kept + cases,
        key=lambda case: (SIZES.index(case["size"]), CASES.index((case["logprobs"], case["checkpointing"]))),
    )
    write_result(
        "scale_memory",
        {
            "tokens": args.tokens,
            "dtype": args.dtype,
            "steps": args.steps,
            "sequence": SEQUENCE,
            "cases": cases,
            "target": "0.5B shape: peak <= 1.25 x (weights + gradients + AdamW state) at the config's micro_batch_tokens",
        },
    )


if __name__ == "__main__":
    main()

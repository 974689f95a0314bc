"""Attention over rows that several sequences share: by the sequences' bounds (trainer.attention) against
the dense [rows, 1, L, L] mask the trainer used before, the same micro-batches, on this machine's device.

Each case is bench/gpu_step.py in a child process of its own (its peak memory its own): environment-
shaped sequences (64 a step, 256-1024 tokens, in groups of two), packed several a row into
micro-batches of `--micro-batch-tokens`, forward, backward and an AdamW step at the model's shape.

Usage: python -m bench.bench_attention [--sizes small,smollm2-135m] [--dtype float32] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.results import write_result

MODES = ("mask", "bounds")


def case(size: str, attention: str, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        "-m",
        "bench.gpu_step",
        "--size",
        size,
        "--attention",
        attention,
        "--dtype",
        args.dtype,
        "--steps",
        str(args.steps),
        "--sequences",
        str(args.sequences),
        "--micro-batch-tokens",
        str(args.micro_batch_tokens),
        "--min-tokens",
        "256",
        "--max-tokens",
        "1024",
    ] + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])
    done = subprocess.run(
        command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=args.limit
    )
    if done.returncode:
        return {"error": done.stderr[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--limit", type=float, default=1800.0)
    args = parser.parse_args()
    sizes = []
    for size in args.sizes.split(","):
        entry = {"size": size}
        for attention in MODES:
            result = case(size, attention, args)
            entry[attention] = result
            print(f"{size} {attention}: {json.dumps(result)[:300]}", flush=True)
        if all("error" not in entry[mode] for mode in MODES):
            mask, bounds = (statistics.median(entry[mode]["step_seconds"]) for mode in MODES)
            entry["seconds_bounds_over_mask"] = round(bounds / mask, 3)
            entry["peak_memory_gib"] = {mode: entry[mode]["peak_memory_gib"] for mode in MODES}
        sizes.append(entry)
    write_result(
        "attention",
        {
            "dtype": args.dtype,
            "steps": args.steps,
            "sequences": args.sequences,
            "micro_batch_tokens": args.micro_batch_tokens,
            "sizes": sizes,
        },
    )


if __name__ == "__main__":
    main()

"""Publish + hot reload of a checkpoint vs restarting vLLM on it, on the tiny model (one server, one run).

    .venv/bin/python -m bench.bench_reload [--reloads 3] [--json out.json]

(a) publish a perturbed checkpoint, then one watcher poll: find it, preflight, pause -> reload ->
    reset -> resume, parity guard, announce. Reported per phase; the median of several reloads.
(b) restart the server on the same checkpoint until /health answers.
Target: (b) / (publish + swap) >= 100.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.results import write_result
from clotho.testing.reloading import perturbed_checkpoint
from inference.parity_guard import ParityGuard
from inference.reload import ServedPolicy
from inference.server import PolicyServer
from inference.tiny_model import build_tiny_model
from inference.watcher import ReloadWatcher
from storage.checkpoints import publish_checkpoint

REPO = Path(__file__).resolve().parents[1]


def tiny_model(cache: Path) -> Path:
    out = cache / "tiny-seed0-untied"
    if not (out / "model.safetensors").exists():
        build_tiny_model(out, seed=0)
    return out


async def reload_rounds(policy: ServedPolicy, base: Path, work: Path, reloads: int) -> list[dict]:
    root = f"file://{work}/store"
    guard = ParityGuard.for_model(base)
    watcher = ReloadWatcher(f"{root}/bench", [policy], guard, cache_dir=work / "cache")
    rounds = []
    for step in range(1, reloads + 1):
        checkpoint = perturbed_checkpoint(base, work / f"checkpoint-{step}", seed=step)
        started = time.perf_counter()
        publish_checkpoint(checkpoint, root, "bench", step)
        published = time.perf_counter()
        [outcome] = await watcher.poll_once()
        done = time.perf_counter()
        if outcome.status != "reloaded":
            raise RuntimeError(f"reload {step} did not succeed: {outcome}")
        rounds.append(
            {
                "step": step,
                "publish_s": published - started,
                "swap_s": outcome.swap_s,  # pause -> reload_weights -> reset_prefix_cache -> resume
                "parity_s": outcome.parity_s,  # reference forward + served greedy completions
                "poll_s": done - published,  # find + preflight + swap + parity + announce
                "publish_to_announce_s": done - started,
            }
        )
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reloads", type=int, default=3, help="reloads to time (the median is reported)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    cache = REPO / ".clotho" / "bench-cache"
    base = tiny_model(cache)
    with tempfile.TemporaryDirectory(prefix="clotho-bench-reload-") as tmp:
        work = Path(tmp)
        server = PolicyServer(base, log_path=cache / "logs" / "vllm-bench-reload.log")
        started = time.perf_counter()
        server.start(timeout=900)
        first_start_s = time.perf_counter() - started
        try:
            rounds = asyncio.run(reload_rounds(ServedPolicy.of(server), base, work, args.reloads))
            newest = work / f"checkpoint-{args.reloads}"
            started = time.perf_counter()
            server.restart(newest, timeout=900)
            restart_s = time.perf_counter() - started
        finally:
            server.stop()
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "step"}
    reload_s = median["publish_s"] + median["swap_s"]
    result = {
        "model": "tiny Qwen2 (2 layers, hidden 128, fp32), vLLM-CPU",
        "first_start_s": first_start_s,
        "restart_with_new_weights_s": restart_s,
        "median": median,
        "rounds": rounds,
        "speedup_publish_plus_swap": restart_s / reload_s,
        "speedup_publish_to_announce_with_parity": restart_s / median["publish_to_announce_s"],
    }
    print(f"server first start                 {first_start_s:8.2f} s")
    print(f"(b) restart on the new checkpoint  {restart_s:8.2f} s")
    print(f"(a) median of {len(rounds)} reloads:")
    for key, value in median.items():
        print(f"    {key:<28}{value:8.3f} s")
    print(f"speed-up, publish + swap           {result['speedup_publish_plus_swap']:8.0f} x  (target >= 100)")
    with_parity = result["speedup_publish_to_announce_with_parity"]
    print(f"speed-up, publish -> announce      {with_parity:8.0f} x  (parity included)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    write_result("reload", {"targets": {"speedup_publish_plus_swap": ">= 100"}, **result})
    if result["speedup_publish_plus_swap"] < 100:
        sys.exit("reload is less than 100x faster than a restart")


if __name__ == "__main__":
    main()

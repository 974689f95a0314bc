"""`clotho reprocess` vs a bare pyarrow scan + write of the same rows, over >= 1 GB of shards.

    python -m bench.bench_reprocess [--gigabytes 1.0] [--rounds 3]

Input: one run of shards of about 64 MB each (16-sequence groups of 512 tokens, random ids and
logprobs: they hardly compress, like real ones), hard links of one written shard under distinct ids
up to --gigabytes. Each side runs in its own process (so its peak RSS is its own) and filters
`score >= 0.5` shard by shard into a new output:
- ours: the reprocess flow (`filter:score_min=0.5`) against a local Prefect server: a task per
  shard, every shard read, checked (storage.shard_checks.check_table), filtered with its groups
  renumbered, checked again, written atomically with its index entry, lineage at the end;
- bare: `pyarrow.dataset` over the same files, each fragment's rows filtered and written with
  `pq.write_table` (zstd), nothing checked.
Sides take turns each round; the bare side runs twice per round and its second run over its first is
the control. Reported: rows/s per side, the ratio ours/bare per round with its 95% interval, peak RSS
per side. Target: ratio >= 0.7, peak RSS bounded (a shard or two, not the input). Written to
bench/results/reprocess.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHARD_GROUPS = 900  # 16 x 512-token sequences each: about 64 MB a shard


def build_input(root: Path, gigabytes: float) -> tuple[str, int, int]:
    import numpy as np

    from core.scored_group import ScoredGroup, ScoredSequence
    from storage.layout import new_shard_id
    from storage.writer import ShardWriter

    rng = np.random.default_rng(0)
    groups = []
    for g in range(SHARD_GROUPS):
        prompt = rng.integers(0, 150_000, 64).tolist()
        sequences = []
        for s in range(16):
            completion = rng.integers(0, 150_000, 448).tolist()
            logprobs = (-rng.exponential(0.3, 448)).astype(np.float32).tolist()
            sequences.append(ScoredSequence.from_prompt(prompt, completion, logprobs, score=float((g + s) % 4) / 3))
        groups.append(ScoredGroup(env="bench", item_id=f"item-{g}", sequences=sequences))
    with ShardWriter(f"file://{root}", "in", tokenizer="tok", max_groups=SHARD_GROUPS, max_bytes=2**40) as writer:
        writer.add_many(groups)
    [first] = list((root / "in" / "rollouts").rglob("*.parquet"))
    size = first.stat().st_size
    copies = max(1, int(gigabytes * 2**30 // size) + (1 if gigabytes * 2**30 % size else 0))
    for _ in range(copies - 1):
        os.link(first, first.with_name(f"{new_shard_id()}.parquet"))
    return f"file://{root}/in", copies, copies * size


def run_side(side: str, source: str, output: Path, env: dict) -> dict:
    shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, __file__, "--side", side, "--source", source, "--output", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def side_main(side: str, source: str, output: str) -> None:
    """One side, timed from its first read to its last write (imports before: the same for both)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from flows.reprocess import reprocess

    started = time.perf_counter()
    if side == "ours":
        lineage = reprocess(
            input_run_url=source, output_url=f"file://{output}/run", operations=["filter:score_min=0.5"]
        )
        rows_in, rows_out = lineage["counts"]["rows_in"], lineage["counts"]["rows_out"]
    else:
        files = sorted(str(p) for p in Path(source.removeprefix("file://"), "rollouts").rglob("*.parquet"))
        dataset = ds.dataset(files, format="parquet")
        rows_in = rows_out = 0
        Path(output).mkdir(parents=True, exist_ok=True)
        for fragment in dataset.get_fragments():
            table = fragment.to_table()
            kept = table.filter(pc.greater_equal(table.column("score"), 0.5))
            pq.write_table(kept, f"{output}/{Path(fragment.path).name}", compression="zstd")
            rows_in, rows_out = rows_in + table.num_rows, rows_out + kept.num_rows
    seconds = time.perf_counter() - started
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's high-water mark.
    status = Path("/proc/self/status").read_text()
    peak_mb = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024
    print(
        json.dumps(
            {
                "side": side,
                "rows_in": rows_in,
                "rows_out": rows_out,
                "seconds": round(seconds, 2),
                "rows_per_s": round(rows_in / seconds, 1),
                "peak_rss_mb": round(peak_mb, 1),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side_main(args.side, args.source, args.output)
        return

    from bench.results import interval, write_result
    from clotho.testing.prefect_server import start_prefect_server

    workdir = Path(tempfile.mkdtemp(prefix="clotho-bench-reprocess-"))
    prefect = start_prefect_server(workdir / "prefect")
    try:
        source, shards, total_bytes = build_input(workdir, args.gigabytes)
        print(f"input: {shards} shards, {total_bytes / 2**30:.2f} GiB", flush=True)
        env = {**os.environ, **prefect.env()}
        sides = ["ours", "bare", "bare_again"]
        rounds = []
        for index in range(args.rounds):
            order = sides[index % len(sides) :] + sides[: index % len(sides)]
            measured = {
                side: run_side("bare" if side == "bare_again" else side, source, workdir / f"out-{side}", env)
                for side in order
            }
            rounds.append(measured)
            print(json.dumps({side: (m["rows_per_s"], m["peak_rss_mb"]) for side, m in measured.items()}), flush=True)
        ratios = [r["ours"]["rows_per_s"] / r["bare"]["rows_per_s"] for r in rounds]
        control = [r["bare_again"]["rows_per_s"] / r["bare"]["rows_per_s"] for r in rounds]
        result = {
            "input_shards": shards,
            "input_gib": round(total_bytes / 2**30, 3),
            "rows": rounds[0]["ours"]["rows_in"],
            "operation": "filter:score_min=0.5",
            "rounds": rounds,
            "ratio_rows_per_s": round(statistics.fmean(ratios), 3),
            "ratio_rows_per_s_interval": interval(ratios),
            "ratio_control": round(statistics.fmean(control), 3),
            "peak_rss_mb_ours": max(r["ours"]["peak_rss_mb"] for r in rounds),
            "peak_rss_mb_bare": max(r["bare"]["peak_rss_mb"] for r in rounds),
            "targets": {"ratio_rows_per_s": ">= 0.7"},
        }
        print(json.dumps(result, indent=1))
        write_result("reprocess", result)
    finally:
        prefect.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

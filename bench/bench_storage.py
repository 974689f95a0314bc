"""Storage benchmark: shard write and read throughput against bare pyarrow, and bytes against JSON lines.

Prints three ratios measured in one run on the same synthetic groups (issue 4 targets):
  write  = bare pq.write_table(Table.from_pylist(rows)) time / ShardWriter time        (>= 0.8)
  read   = bare pyarrow.dataset scan time / ShardReader.batches() time                   (>= 0.8)
  bytes  = shard bytes on disk / Atropos `process` JSON lines bytes                      (<= 1/3)

Usage: python -m bench.bench_storage [--groups 2000] [--group-size 8] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from bench.results import write_result
from core.scored_group import ScoredGroup, ScoredSequence
from storage.layout import rollouts_url
from storage.reader import ShardReader
from storage.schema import SHARD_SCHEMA, groups_to_table
from storage.writer import ShardWriter

VOCAB = 150_000
GROUPS_PER_SHARD = 256


def make_groups(count: int, group_size: int, seed: int) -> list[ScoredGroup]:
    """GRPO-like groups: one prompt of 100-300 tokens, completions of 200-700 sampled tokens each."""
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(count):
        prompt = rng.integers(0, VOCAB, int(rng.integers(100, 300))).tolist()
        sequences = []
        for _ in range(group_size):
            length = int(rng.integers(200, 700))
            sequences.append(
                ScoredSequence.from_prompt(
                    prompt,
                    rng.integers(0, VOCAB, length).tolist(),
                    (-rng.exponential(0.4, length)).astype(np.float32).tolist(),  # sampler logprobs
                    score=float(rng.integers(0, 2)),
                    finish_reason="stop" if rng.random() < 0.9 else "length",
                )
            )
        groups.append(ScoredGroup(env="bench", item_id=f"item-{index}", sequences=sequences, policy_version=3))
    return groups


def best_of(repeats: int, *runs: Callable[[int], object]) -> list[float]:
    """Best time of each run; the runs take turns so load from other processes hits them alike."""
    times: list[list[float]] = [[] for _ in runs]
    for attempt in range(repeats):
        for run, spent in zip(runs, times, strict=True):
            start = time.perf_counter()
            run(attempt)
            spent.append(time.perf_counter() - start)
    return [min(spent) for spent in times]


def atropos_jsonl(groups: list[ScoredGroup], path: Path) -> None:
    """Atropos `process` output: one ScoredDataGroup JSON object per line (masks: -100 = not trained)."""
    with path.open("w") as file:
        for group in groups:
            record = {
                "tokens": [s.tokens for s in group.sequences],
                "masks": [[t if m else -100 for t, m in zip(s.tokens, s.mask, strict=True)] for s in group.sequences],
                "scores": group.scores,
                "advantages": None,
                "ref_logprobs": None,
                "messages": None,
                "generation_params": None,
                "inference_logprobs": [s.logprobs for s in group.sequences],
                "group_overrides": {},
                "overrides": [],
                "images": [],
            }
            file.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="Directory to write into (default: a temporary one).")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-storage-", dir=args.dir))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    start = time.perf_counter()
    groups = make_groups(args.groups, args.group_size, seed=0)
    tokens = sum(g.num_tokens for g in groups)
    sequences = sum(len(g.sequences) for g in groups)
    made_s = time.perf_counter() - start
    print(f"{len(groups)} groups, {sequences} sequences, {tokens:,} tokens (made in {made_s:.1f} s)")
    chunks = [groups[i : i + GROUPS_PER_SHARD] for i in range(0, len(groups), GROUPS_PER_SHARD)]
    groups_to_table(groups[:1], "warm-up")  # first-call imports are not throughput
    # The same rows as plain Python values, for the bare writer (prepared outside the timing).
    rows = [groups_to_table(chunk, "bench-tokenizer").to_pylist() for chunk in chunks]

    def ours_write(attempt: int) -> None:
        with ShardWriter(str(work), f"w{attempt}", tokenizer="bench-tokenizer", max_groups=GROUPS_PER_SHARD) as writer:
            for group in groups:
                writer.add(group)

    def bare_write(attempt: int) -> None:
        directory = work / f"bare{attempt}"
        directory.mkdir()
        for index, chunk_rows in enumerate(rows):
            pq.write_table(
                pa.Table.from_pylist(chunk_rows, schema=SHARD_SCHEMA),
                directory / f"{index}.parquet",
            )

    prebuilt = [pa.Table.from_pylist(chunk_rows, schema=SHARD_SCHEMA) for chunk_rows in rows]

    def bare_write_prebuilt(attempt: int) -> None:
        directory = work / f"prebuilt{attempt}"
        directory.mkdir()
        for index, table in enumerate(prebuilt):
            pq.write_table(table, directory / f"{index}.parquet")

    write_ours, write_bare, write_prebuilt = best_of(args.repeats, ours_write, bare_write, bare_write_prebuilt)

    dataset_path = rollouts_url(str(work), "w0")

    def ours_read(attempt: int) -> None:
        rows_read = sum(batch.num_sequences for batch in ShardReader(str(work), "w0").batches())
        assert rows_read == sequences, (rows_read, sequences)

    def bare_read(attempt: int) -> None:
        assert ds.dataset(dataset_path, format="parquet").to_table().num_rows == sequences

    read_bare, read_ours = best_of(args.repeats, bare_read, ours_read)
    [read_groups] = best_of(1, lambda _: sum(1 for _ in ShardReader(str(work), "w0").groups()))

    shard_bytes = sum(f.stat().st_size for f in Path(dataset_path).rglob("*.parquet"))
    bare_bytes = sum(f.stat().st_size for f in (work / "bare0").rglob("*.parquet"))
    jsonl = work / "atropos.jsonl"
    atropos_jsonl(groups, jsonl)
    jsonl_bytes = jsonl.stat().st_size

    def rate(seconds: float) -> str:
        return f"{seconds:7.3f} s  {tokens / seconds / 1e6:6.1f} M tokens/s"

    print(f"\nwrite  ShardWriter (groups -> zstd shards, fsync, link)   {rate(write_ours)}")
    print(f"       bare from_pylist + pq.write_table (same rows)       {rate(write_bare)}")
    print(f"       bare pq.write_table of prebuilt tables (info)       {rate(write_prebuilt)}")
    print(f"read   ShardReader.batches() (list, read, check, ledger)   {rate(read_ours)}")
    print(f"       bare pyarrow.dataset(...).to_table()                {rate(read_bare)}")
    print(f"       ShardReader.groups() -> ScoredGroup objects (info)  {rate(read_groups)}")
    print(f"bytes  shards {shard_bytes:,}  bare parquet {bare_bytes:,}  Atropos JSON lines {jsonl_bytes:,}")
    print("\nratios (targets: write >= 0.8, read >= 0.8, bytes <= 0.333)")
    prebuilt_ratio = write_prebuilt / write_ours
    print(f"  write  {write_bare / write_ours:.2f}   (vs prebuilt-table write: {prebuilt_ratio:.2f}, info)")
    print(f"  read   {read_bare / read_ours:.2f}")
    print(f"  bytes  {shard_bytes / jsonl_bytes:.3f}   (1/{jsonl_bytes / shard_bytes:.1f})")
    print(f"  cpus {os.cpu_count()}, pyarrow {pa.__version__}, dir {work}")
    write_result(
        "storage",
        {
            "targets": {"write_ratio": ">= 0.8", "read_ratio": ">= 0.8", "bytes_ratio": "<= 0.333"},
            "write_ratio": round(write_bare / write_ours, 3),
            "read_ratio": round(read_bare / read_ours, 3),
            "bytes_ratio": round(shard_bytes / jsonl_bytes, 3),
            "write_vs_prebuilt_ratio": round(prebuilt_ratio, 3),
            "shard_bytes": shard_bytes,
            "bare_parquet_bytes": bare_bytes,
            "atropos_jsonl_bytes": jsonl_bytes,
        },
    )


if __name__ == "__main__":
    main()

"""The benchmark table of the README, rendered from bench/results/*.json (what `make bench` wrote).

    python bench/report.py            print the table
    python bench/report.py --readme   rewrite the README's table between its bench markers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- bench:start (python bench/report.py --readme) -->", "<!-- bench:end -->"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _measured(record: dict) -> str:
    return f"{record['measured_at'][:10]}, {record['commit']}, {record['machine']['cpus']} cpus"


def rows() -> list[list[str]]:
    table = []
    if storage := _load("storage"):
        r = storage["result"]
        table.append(["`bench_storage.py`", "ShardWriter / ShardReader vs bare `pq.write_table` / `pyarrow.dataset`; bytes vs Atropos JSON lines",
                      ">= 0.8, >= 0.8, <= 1/3", f"{r['write_ratio']}, {r['read_ratio']}, {r['bytes_ratio']}", _measured(storage)])  # fmt: skip
    if rollout := _load("rollout"):
        parts = []
        for w in rollout["result"]["workloads"]:
            interval = w.get("ratio_interval_vs_both_bare") or {}
            control = w.get("ratio_bare_again")
            rounds = f", geometric mean of rounds {interval['mean']} [{interval['low']}-{interval['high']}]" if interval else ""
            parts.append(f"{w['max_tokens']}-token samples: total {w['ratio_tokens_per_s']}{rounds} (control {control})")
        table.append(["`bench_rollout.py`", "the Prefect rollout flow vs a bare asyncio client sending the same requests (control: the bare client again)",
                      ">= 0.95", "; ".join(parts), _measured(rollout)])  # fmt: skip
    if trainer := _load("trainer"):
        r = trainer["result"]
        waste = ", ".join(f"{v:.1%}" for v in r["padding_waste"].values())
        table.append(["`bench_trainer.py`", "the DeepSpeed trainer vs a plain PyTorch AdamW loop on the same packed batches; padding waste",
                      ">= 0.9, <= 5%", f"{r['ratio']}, {waste}", _measured(trainer)])  # fmt: skip
    if reload := _load("reload"):
        r = reload["result"]
        table.append(["`bench_reload.py`", "publish + hot reload vs restarting vLLM on the new weights", ">= 100x",
                      f"{r['speedup_publish_plus_swap']:.0f}x ({r['speedup_publish_to_announce_with_parity']:.0f}x with the parity check)",
                      _measured(reload)])  # fmt: skip
    if pipeline := _load("pipeline"):
        r = pipeline["result"]
        lags = [side for side in ("async_k1", "async_k2") if f"ratio_time_to_threshold_{side}" in r]
        times = ", ".join(f"k={side[-1]} {r[f'ratio_time_to_threshold_{side}']}x" for side in lags)
        paces = ", ".join(f"k={side[-1]} {r.get(f'ratio_seconds_per_rl_step_{side}')}x" for side in lags)
        utilization = ", ".join(f"k={side[-1]} {r.get(f'sample_utilization_{side}')}" for side in lags)
        memory = ""
        if (measured := _load("pipeline_memory")) and measured["result"].get("rss_growth_max") is not None:
            m = measured["result"]
            measured_groups = m.get("measured_groups", m["groups"])
            warmup = f" after {m['warmup_groups']:,} warm-up groups" if m.get("warmup_groups") else ""
            memory = f"; RSS of every process over {measured_groups:,.0f} sampled groups{warmup} grew at most {m['rss_growth_max']:.1%}"
        table.append(["`bench_pipeline.py`", "`clotho run` asynchronous (k = 1, 2) vs synchronous (k = 0): wall time to a training reward (control: k = 0 again), sample utilization, RSS of every process",
                      "<= 0.8x, >= 0.9, < 10%", f"time {times} (control {r.get('ratio_time_to_threshold_sync_again')}); s/step {paces}; utilization {utilization}{memory}",
                      _measured(pipeline)])  # fmt: skip
    if reprocess := _load("reprocess"):
        r = reprocess["result"]
        interval = r.get("ratio_rows_per_s_interval") or {}
        rounds = f" [{interval['low']}-{interval['high']}]" if interval else ""
        table.append(["`bench_reprocess.py`", f"`clotho reprocess {r['operation']}` vs a bare `pyarrow.dataset` scan + write of the same rows over {r['input_gib']} GiB of shards (control: bare again); peak RSS",
                      ">= 0.7", f"{r['ratio_rows_per_s']}{rounds} (control {r['ratio_control']}); peak RSS {r['peak_rss_mb_ours']:.0f} MB vs {r['peak_rss_mb_bare']:.0f} MB",
                      _measured(reprocess)])  # fmt: skip
    if run_length := _load("run_length"):
        r = run_length["result"]
        local = r["local"]
        largest = max((side for side in local if side.isdigit()), key=int)
        s3 = r.get("s3", {})
        s3_sizes = sorted((side for side in s3 if side.isdigit()), key=int)
        lists = ", ".join(f"{int(size):,}: {s3[size]['list_requests_per_poll']:g}" for size in s3_sizes)
        table.append(["`bench_run_length.py`", "the trainer's poll (list new shards, filter by the ledger) at 1k..100k shards vs at 1k (control: 1k again); ledger bytes; S3 LIST requests per poll",
                      "<= 2x, < 64 KB, <= 2x",
                      f"{int(largest):,} shards {local[largest]['ratio_poll_to_1000']}x (control {local['control_1000']['ratio_poll_to_1000']}x, "
                      f"full listing {local[largest]['full_listing_s']} s vs poll {local[largest]['poll_s_median'] * 1e3:.1f} ms); ledger at most {r['ledger_bytes_max'] / 1024:.1f} KB; "
                      f"LIST per poll {lists}", _measured(run_length)])  # fmt: skip
    if sandbox := _load("sandbox"):
        r = sandbox["result"]
        interval = r.get("ratio_interval") or {}
        rounds = f" [{interval['low']}-{interval['high']}]" if interval else ""
        levels = ", ".join(f"{level} {ratio}x" for level, ratio in r["ratio_by_level"].items())
        table.append(["`bench_sandbox.py`", f"`{r['program']}` in the sandbox ({r['isolation']}: namespaces, rlimits, own uid) vs a bare `python -c` subprocess, wall time per launch (control: bare again)",
                      "none set", f"{r['ratio_sandbox_to_bare']}x{rounds} (control {r['ratio_control']}x), {r['mean_s'][r['isolation']] * 1e3:.0f} ms vs {r['mean_s']['bare'] * 1e3:.0f} ms; by level {levels}",
                      _measured(sandbox)])  # fmt: skip
    if remote := _load("remote"):
        adapters = remote["result"]["adapters"]

        def cell(name: str, r: dict) -> str:
            interval = r.get("ratio_interval") or {}
            rounds = f" [{interval['low']}-{interval['high']}]" if interval else ""
            return f"{name} {r['ratio_remote_to_inproc']}x{rounds} ({r['added_ms_per_group']:+} ms, control {r['ratio_control']}x, venv {r['venv_mb'] / 1024:.2f} GB)"

        table.append(["`bench_remote.py`", "a group collected through `clotho env serve` vs in process, same venv and config, per adapter (control: in process again)",
                      "none set", "; ".join(cell(name, r) for name, r in adapters.items()), _measured(remote)])  # fmt: skip
    return table


def markdown() -> str:
    lines = ["| script | compares | target | measured | when, commit, machine |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    return "\n".join(lines)


def readme_block() -> str:
    return f"{START}\n{markdown()}\n{END}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readme", action="store_true", help="rewrite the README's table")
    args = parser.parse_args()
    if not args.readme:
        print(markdown())
        return
    text = README.read_text()
    if START not in text or END not in text:
        sys.exit(f"{README} has no bench markers ({START} ... {END})")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    README.write_text(before + readme_block() + after)
    print(f"README table rewritten from {RESULTS}")


if __name__ == "__main__":
    main()

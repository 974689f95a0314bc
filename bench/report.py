"""The figures the README and the docs show, rendered from what was measured and what is committed:
the benchmark tables of docs/benchmarks.md from bench/results/*.json (what `make bench` wrote), the
README's demo figures from bench/results/demo.json, its environment listing from the file itself.

    python -m bench.report            print the tables
    python -m bench.report --readme   rewrite every block between its markers: the benchmark and
                                      peer tables in docs/benchmarks.md, the demo figures and the
                                      listing of environments/bundled/capitals.py in the README
    python -m bench.report --record-demo [.clotho/demo/summary.json]
                                      keep what a `make demo` measured as bench/results/demo.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
LISTED = "environments/bundled/capitals.py"
LISTING_START, LISTING_END = (
    f"<!-- listing:start {LISTED} (python -m bench.report --readme) -->",
    "<!-- listing:end -->",
)
START, END = "<!-- bench:start (python -m bench.report --readme) -->", "<!-- bench:end -->"
DEMO_START, DEMO_END = "<!-- demo:start (python -m bench.report --readme) -->", "<!-- demo:end -->"
PEER_START, PEER_END = "<!-- peer:start (python -m bench.report --readme) -->", "<!-- peer:end -->"
SAMPLING_START, SAMPLING_END = "<!-- sampling:start (python -m bench.report --readme) -->", "<!-- sampling:end -->"
SCALE_START, SCALE_END = "<!-- scale:start (python -m bench.report --readme) -->", "<!-- scale:end -->"
SIDE_LABELS = {"clotho": "clotho", "trl": "TRL GRPOTrainer", "clotho-untempered": "clotho, untempered (before)"}
DEMO_SUMMARY = Path(__file__).resolve().parents[1] / ".clotho" / "demo" / "summary.json"
# What each recorded demo ran: `clotho demo` (SmolLM2), `clotho demo --tiny` (the small random model).
DEMO_CONFIGS = {
    "demo": Path(__file__).resolve().parents[1] / "runs" / "smollm2-times-tables.yaml",
    "demo-tiny": Path(__file__).resolve().parents[1] / "runs" / "demo.yaml",
}


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _measured(record: dict) -> str:
    return f"{record['measured_at'][:10]}, {record['commit']}, {record['machine']['cpus']} cpus"


def rows() -> list[list[str]]:
    table = []
    if storage := _load("storage"):
        r = storage["result"]
        table.append(
            [
                "`bench_storage.py`",
                "ShardWriter / ShardReader vs bare `pq.write_table` / `pyarrow.dataset`; bytes vs Atropos JSON lines",
                ">= 0.8, >= 0.8, <= 1/3",
                f"{r['write_ratio']}, {r['read_ratio']}, {r['bytes_ratio']}",
                _measured(storage),
            ]
        )
    if rollout := _load("rollout"):
        parts = []
        for w in rollout["result"]["workloads"]:
            interval = w.get("ratio_interval_vs_both_bare") or {}
            control = w.get("ratio_bare_again")
            rounds = (
                f", geometric mean of rounds {interval['mean']} [{interval['low']}-{interval['high']}]"
                if interval
                else ""
            )
            parts.append(
                f"{w['max_tokens']}-token samples: total {w['ratio_tokens_per_s']}{rounds} (control {control})"
            )
        table.append(
            [
                "`bench_rollout.py`",
                "the Prefect rollout flow vs a bare asyncio client sending the same requests (control: the bare client again)",
                ">= 0.95",
                "; ".join(parts),
                _measured(rollout),
            ]
        )
    if trainer := _load("trainer"):
        r = trainer["result"]
        waste = ", ".join(f"{v:.1%}" for v in r["padding_waste"].values())
        if "control_padding_waste" in r:  # the padded-batch control (issue 35)
            control = ", ".join(f"{v:.1%}" for v in r["control_padding_waste"].values())
            low, high = r["step_ratio_range"]
            demo = ""
            if "demo" in r:  # the demo's RL step, answers of about one length (issue 35)
                demo_low, demo_high = r["demo"]["step_ratio_range"]
                demo = f"; demo step {r['demo']['ratio']} (steps {demo_low}-{demo_high})"
            table.append(
                [
                    "`bench_trainer.py`",
                    "the DeepSpeed trainer (its rows: packed, padded, a group's prompt laid out once) vs the best plain way: "
                    "the same whole sequences as padded batches in plain PyTorch + AdamW, on mixed steps and on the "
                    "demo's RL step; padding waste of each (arithmetic, guess_number, mixed)",
                    ">= 0.95",
                    f"mixed {r['ratio']} (steps {low}-{high}){demo}; padding {waste} vs {control}",
                    _measured(trainer),
                ]
            )
        else:
            table.append(
                [
                    "`bench_trainer.py`",
                    "the DeepSpeed trainer vs a plain PyTorch AdamW loop on the same packed batches; padding waste",
                    ">= 0.9, <= 5%",
                    f"{r['ratio']}, {waste}",
                    _measured(trainer),
                ]
            )
    if reload := _load("reload"):
        r = reload["result"]
        table.append(
            [
                "`bench_reload.py`",
                "publish + hot reload vs restarting vLLM on the new weights",
                ">= 100x",
                f"{r['speedup_publish_plus_swap']:.0f}x ({r['speedup_publish_to_announce_with_parity']:.0f}x with the parity check)",
                _measured(reload),
            ]
        )
    if inflight := _load("inflight"):
        r = inflight["result"]
        ratio, pause = r["pause_ratio_in_flight_to_drain"], r["median_pause_s"]
        table.append(
            [
                "`bench_inflight.py`",
                f"how long a reload stops sampling, in-flight vs drain, with {r['streams']} generations of {r['tokens']} tokens in flight",
                "<= 0.2x",
                f"{ratio['mean']}x [{ratio['low']}-{ratio['high']}] ({pause['in-flight']:.3f} s vs {pause['drain']:.2f} s)",
                _measured(inflight),
            ]
        )
    if inflight_pipeline := _load("inflight_pipeline"):
        r = inflight_pipeline["result"]
        ratio = r["ratio_time_to_threshold_in-flight_interval"] or {}
        shown = f"{r['ratio_time_to_threshold_in-flight']}x" + (f" [{ratio['low']}-{ratio['high']}]" if ratio else "")
        table.append(
            [
                "`bench_inflight.py`",
                "`clotho run` on the repeat task with max_tokens 256, a reload every step: in-flight vs drain, wall time "
                "to a training reward and seconds per RL step (control: in-flight again), time each reload stops sampling, trainer idle fraction",
                "<= 0.9x",
                f"time {shown} (control {r['ratio_time_to_threshold_in-flight_again']}x); s/step {r['ratio_seconds_per_rl_step_in-flight']}x "
                f"(control {r['ratio_seconds_per_rl_step_in-flight_again']}x); stopped "
                f"{r['swap_s_median_in-flight']} s vs {r['swap_s_median_drain']} s "
                f"per reload; idle {r['idle_fraction_in-flight']} vs {r['idle_fraction_drain']}",
                _measured(inflight_pipeline),
            ]
        )
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
        table.append(
            [
                "`bench_pipeline.py`",
                "`clotho run` asynchronous (k = 1, 2) vs synchronous (k = 0): wall time to a training reward "
                "(control: k = 0 again), sample utilization, RSS of every process",
                "<= 0.8x, >= 0.9, < 10%",
                f"time {times} (control {r.get('ratio_time_to_threshold_sync_again')}); s/step {paces}; utilization {utilization}{memory}",
                _measured(pipeline),
            ]
        )
    if reprocess := _load("reprocess"):
        r = reprocess["result"]
        interval = r.get("ratio_rows_per_s_interval") or {}
        rounds = f" [{interval['low']}-{interval['high']}]" if interval else ""
        table.append(
            [
                "`bench_reprocess.py`",
                f"`clotho reprocess {r['operation']}` vs a bare `pyarrow.dataset` scan + write of the same rows over "
                f"{r['input_gib']} GiB of shards (control: bare again); peak RSS",
                ">= 0.7",
                f"{r['ratio_rows_per_s']}{rounds} (control {r['ratio_control']}); peak RSS "
                f"{r['peak_rss_mb_ours']:.0f} MB vs {r['peak_rss_mb_bare']:.0f} MB",
                _measured(reprocess),
            ]
        )
    if run_length := _load("run_length"):
        r = run_length["result"]
        local = r["local"]
        largest = max((side for side in local if side.isdigit()), key=int)
        s3 = r.get("s3", {})
        s3_sizes = sorted((side for side in s3 if side.isdigit()), key=int)
        lists = ", ".join(f"{int(size):,}: {s3[size]['list_requests_per_poll']:g}" for size in s3_sizes)
        table.append(
            [
                "`bench_run_length.py`",
                "the trainer's poll (list new shards, filter by the ledger) at 1k..100k shards vs at 1k (control: 1k "
                "again); ledger bytes; S3 LIST requests per poll",
                "<= 2x, < 64 KB, <= 2x",
                f"{int(largest):,} shards {local[largest]['ratio_poll_to_1000']}x (control {local['control_1000']['ratio_poll_to_1000']}x, "
                f"full listing {local[largest]['full_listing_s']} s vs poll "
                f"{local[largest]['poll_s_median'] * 1e3:.1f} ms); ledger at most {r['ledger_bytes_max'] / 1024:.1f} KB; "
                f"LIST per poll {lists}",
                _measured(run_length),
            ]
        )
    if sandbox := _load("sandbox"):
        r = sandbox["result"]
        interval = r.get("ratio_interval") or {}
        rounds = f" [{interval['low']}-{interval['high']}]" if interval else ""
        levels = ", ".join(f"{level} {ratio}x" for level, ratio in r["ratio_by_level"].items())
        table.append(
            [
                "`bench_sandbox.py`",
                f"`{r['program']}` in the sandbox ({r['isolation']}: namespaces, rlimits, own uid) vs a bare `python "
                "-c` subprocess, wall time per launch (control: bare again)",
                "none set",
                f"{r['ratio_sandbox_to_bare']}x{rounds} (control {r['ratio_control']}x), "
                f"{r['mean_s'][r['isolation']] * 1e3:.0f} ms vs {r['mean_s']['bare'] * 1e3:.0f} ms; by level {levels}",
                _measured(sandbox),
            ]
        )
    if peer := _load("peer"):
        cells = []
        for name, task in peer["result"]["tasks"].items():
            pace, minutes = task["ratio_seconds_per_step"], task["ratio_minutes_to_threshold"]
            cells.append(f"{name}: s/step {_ratio(pace)}, minutes to {task['threshold']} {_ratio(minutes)}")
        table.append(
            [
                "`bench_peer.py`",
                "clotho (`clotho run`) vs TRL's GRPOTrainer, same task, start, settings and seeds, one evaluator outside both (the table below)",
                "<= 1.0",
                "; ".join(cells),
                _measured(peer),
            ]
        )
    if recipe := _load("recipe"):
        r = recipe["result"]
        seeds = "; ".join(
            f"seed {run['seed']}: {run['start']:.2f} -> {run['end']:.2f} (best {run['best']:.2f}), +{r['gain']:.2f} after "
            + ("never" if run["minutes_to_gain"] is None else f"{run['minutes_to_gain']:.1f} min")
            + f", {run['steps']} steps, {run['seconds_per_step']} s/step, evaluation {run['evaluation_s_median']} s, "
            f"storage {run['storage']['checkpoints']:.0f} checkpoints {run['storage']['checkpoint_bytes'] / 1e9:.2f} GB "
            f"({run['storage']['checkpoint_bytes'] / max(run['storage']['largest_checkpoint_bytes'], 1):.1f}x the largest)"
            for run in r["runs"]
        )
        table.append(
            [
                "`bench_recipe.py`",
                f"a real model learns: `{r['config']}` ({r['model']}, pure RL) per seed, greedy accuracy on the held-out "
                "problems from the model's own start",
                f"+{r['gain']:.2f} within {r['minutes']:.0f} min in every seed",
                f"{r['seeds_met']} of {r['seeds']} seeds; {seeds}",
                _measured(recipe),
            ]
        )
    if remote := _load("remote"):
        adapters = remote["result"]["adapters"]

        def cell(name: str, r: dict) -> str:
            interval = r.get("ratio_interval") or {}
            rounds = f" [{interval['low']}-{interval['high']}]" if interval else ""
            return (
                f"{name} {r['ratio_remote_to_inproc']}x{rounds} ({r['added_ms_per_group']:+} ms, control "
                f"{r['ratio_control']}x, venv {r['venv_mb'] / 1024:.2f} GB)"
            )

        table.append(
            [
                "`bench_remote.py`",
                "a group collected through `clotho env serve` vs in process, same venv and config, per adapter (control: in process again)",
                "none set",
                "; ".join(cell(name, r) for name, r in adapters.items()),
                _measured(remote),
            ]
        )
    return table


def _ratio(summary: dict) -> str:
    """A clotho / TRL ratio over seeds: their mean [the 95% interval of their geometric mean]
    (range), or why there is none."""
    if summary["mean"] is None:
        return "none (a side never got there)"
    interval = summary.get("interval")
    rounds = f" [{interval['low']}-{interval['high']}]" if interval else ""
    low, high = summary["range"]
    return f"{summary['mean']}x{rounds} (seeds {low}-{high})"


def peer_text(name: str = "peer") -> str:
    """A table of bench/bench_peer.py's two sides per task, from bench/results/NAME.json: peer (clotho
    against TRL's GRPOTrainer, the README's) or sampling (clotho against its untempered objective)."""
    record = _load(name)
    if record is None:
        return f"No such run is recorded yet (`python -m bench.bench_peer --result {name}`)."
    first, second = record["result"].get("sides", ["clotho", "trl"])
    lines = [
        "| task (steps, start) | side | seconds per step | minutes to threshold | reward at the last step | held "
        "out, last | late drop | runs reaching it | start-up s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task_name, task in record["result"]["tasks"].items():
        for side in (first, second):
            runs = [run[side] for run in task["runs"]]

            def spread(key: str, digits: int = 2, runs: list = runs) -> str:
                values = [run[key] for run in runs if run.get(key) is not None]
                if not values:
                    return "-"
                middle = sorted(values)[len(values) // 2]
                return f"{middle:.{digits}f}" + (
                    f" ({min(values):.{digits}f}-{max(values):.{digits}f})" if len(values) > 1 else ""
                )

            label = f"{task_name} ({task['steps']}, {task['start']})" if side == first else ""
            target = f"{task['threshold']}{' held out' if task.get('threshold_on') == 'held_out' else ''}"
            lines.append(
                f"| {label} | {SIDE_LABELS[side]} | {spread('seconds_per_step')} | "
                f"{spread('minutes_to_threshold')} (to {target}) | {spread('reward_last')} | {spread('held_out_last')} | "
                f"{spread('late_drop')} | {task['reached_threshold'][side]} of {len(runs)} | {spread('startup_s', 0)} |"
            )
        ratio = f"**{SIDE_LABELS[first]} / {SIDE_LABELS[second]}**"
        lines.append(
            f"| | {ratio} | {_ratio(task['ratio_seconds_per_step'])} | {_ratio(task['ratio_minutes_to_threshold'])} | | | | | |"
        )
    seeds = len(next(iter(record["result"]["tasks"].values()))["runs"])
    lines.append("")
    lines.append(
        f"Medians over {seeds} seeds (range in brackets); the late drop is a run's best evaluated reward minus its reward at the "
        "last step; ratios are per seed: their mean [the 95% interval of their geometric mean] (their range). "
        f"Measured on {record['machine']['cpus']} CPU cores ({_task_provenance(record)}; `bench/results/{name}.json`)."
    )
    return "\n".join(lines)


def _task_provenance(record: dict) -> str:
    """When and at which commit: the record's, or each task's where a run of some tasks kept others."""
    tasks = record["result"]["tasks"]
    whens = {
        (task.get("measured_at", record["measured_at"])[:10], task.get("commit", record["commit"]))
        for task in tasks.values()
    }
    if len(whens) == 1:
        when, commit = next(iter(whens))
        return f"{when}, {commit}"
    return "; ".join(
        f"{name} {task.get('measured_at', record['measured_at'])[:10]}, {task.get('commit', record['commit'])}"
        for name, task in tasks.items()
    )


def markdown() -> str:
    lines = ["| script | compares | target | measured | when, commit, machine |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    return "\n".join(lines)


def bench_block() -> str:
    return f"{START}\n{markdown()}\n{END}"


def demo_text() -> str:
    """The README's demo figures: what `make demo` measured (bench/results/demo.json), then what
    `clotho demo --tiny` measured (bench/results/demo-tiny.json)."""
    record = _load("demo")
    text = (
        real_demo_text(record)
        if record is not None
        else "No demo run is recorded yet (`make demo`, then `python -m bench.report --record-demo`)."
    )
    tiny = _load("demo-tiny")
    return text if tiny is None else f"{text}\n\n{tiny_demo_text(tiny)}"


def _history(runs: list[dict], config: str, gain_key: str, gain_of: str) -> str:
    if len(runs) < 2:
        return ""
    gains = ", ".join(f"{run[gain_key]:+.2f}" for run in runs)
    return (
        f" All {len(runs)} demos recorded with this `{config}`, oldest first: {gain_of} {gains}; "
        f"{sum(run['criterion_met'] for run in runs)} of {len(runs)} met the criterion, "
        f"{sum(run['stopped_by_rule'] for run in runs)} stopped on the rule, the longest took "
        f"{max(run['demo_minutes'] for run in runs):.1f} minutes."
    )


def _ending(r: dict, last: dict, what: str) -> str:
    stopped = r.get("stopped_by_rule")
    ending = (
        f"{what} stopped on its rule ({stopped['rule']}) at step {stopped['version']}"
        if stopped
        else f"{what} ran all its steps, to step {last['step']}"
    )
    if best := r.get("best"):
        ending += (
            f" (its best checkpoint, step {best['step']} at held-out {best['reward']:.2f}, kept as `checkpoints/BEST`)"
        )
    return ending


def real_demo_text(record: dict) -> str:
    r = record["result"]
    curve, verdict = r["curve"], r["verdict"]
    last = curve[-1]
    window = verdict.get("window", 1)
    end_is = "its last evaluation" if window == 1 else f"the mean of its last {window} evaluations"
    reached = next((row for row in curve if row["reward"] >= verdict["start"] + 0.30 - 1e-9), None)
    reached_text = (
        f"+0.30 first reached at step {reached['step']}, {reached['minutes']:.1f} minutes in"
        if reached
        else "+0.30 not reached"
    )
    whole = (
        f"; the whole `clotho demo`, its Prefect server's start and the model's conversion included, took "
        f"{r['demo_minutes']:.1f} minutes."
        if "demo_minutes" in r
        else "."
    )
    seconds = [row["seconds"] for row in curve if "seconds" in row]
    evaluation = (
        f" Each evaluation ({int(last.get('items', 0))} items) answered in {min(seconds):.0f}-{max(seconds):.0f} s."
        if seconds
        else ""
    )
    shown = ""
    if completions := r.get("completions"):
        first, final = completions["first"][0], completions["last"][0]
        shown = (
            f' Sampled at the start: "{first["prompt"]}" → "{first["completion"].strip()[:80]}" (score '
            f'{first["score"]:.2f}); at the end: "{final["prompt"]}" → "{final["completion"].strip()[:80]}" '
            f"(score {final['score']:.2f})."
        )
    return (
        f"Measured on {record['machine']['cpus']} CPU cores ({record['measured_at'][:10]}, {record['commit']}; "
        f"`bench/results/demo.json`): greedy accuracy on the held-out problems {verdict['start']:.2f} at the start "
        f"(the model's own), {verdict['end']:.2f} at step {last['step']} ({end_is}), {verdict['rl_gain']:+.2f}; "
        f"{reached_text}; {_ending(r, last, 'RL')}, {last['minutes']:.1f} minutes after the pipeline started (the "
        f"policy server's start-up included){whole}{evaluation}{shown}"
        + _history(r.get("runs", []), "runs/smollm2-times-tables.yaml", "rl_gain", "RL added")
    )


def tiny_demo_text(record: dict) -> str:
    r = record["result"]
    curve, verdict = r["curve"], r["verdict"]
    last = curve[-1]
    window = verdict.get("window", 1)
    plateau_is, end_is = (
        ("its best evaluation", "its last evaluation")
        if window == 1
        else (f"its best mean of {window} evaluations in a row", f"the mean of its last {window} evaluations")
    )
    whole = f"; the whole `clotho demo --tiny` took {r['demo_minutes']:.1f} minutes." if "demo_minutes" in r else "."
    return (
        f"`clotho demo --tiny`, the small random model (4 layers, hidden 256) of `runs/demo.yaml` on the `compare` "
        f"task, SFT on eight demonstrations then RL (measured {record['measured_at'][:10]}, {record['commit']}; "
        f"`bench/results/demo-tiny.json`): held-out reward {verdict['start']:.2f} at the start, "
        f"{verdict['sft_plateau']:.2f} after SFT ({plateau_is}), {verdict['end']:.2f} at step {last['step']} after RL "
        f"({end_is}); {_ending(r, last, 'RL')}, {last['minutes']:.1f} minutes after the pipeline started{whole}"
        + _history(r.get("runs", []), "runs/demo.yaml", "rl_gain", "RL added over the SFT plateau")
    )


def peer_block() -> str:
    return f"{PEER_START}\n{peer_text()}\n{PEER_END}"


def sampling_block() -> str:
    return f"{SAMPLING_START}\n{peer_text('sampling')}\n{SAMPLING_END}"


def scale_memory_text() -> str:
    """The trainer step's peak RSS per size, before and after the cuts (bench_scale_memory.py)."""
    record = _load("scale_memory")
    if not record:
        return "_not measured yet: python -m bench.bench_scale_memory_"
    r = record["result"]
    lines = [
        f"A trainer step at micro_batch_tokens {r['tokens']}, {r['dtype']}, sequences of {r['sequence']} tokens "
        f"({_measured(record)}; each case names its commit in the JSON). State: weights, gradients and AdamW's "
        "moments, 16 bytes a parameter.",
        "",
        "| size | vocab | logprobs | gradient checkpointing | peak RSS GiB | state GiB | peak over state | whole fp32 logits GiB | s / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    parameters = {case["size"]: case["parameters"] for case in r["cases"] if "parameters" in case}
    for case in r["cases"]:
        state = 16 * parameters[case["size"]] if case["size"] in parameters else float("nan")
        if "error" in case:
            peak, over, seconds = f"killed: {case['error']}", "-", "-"
        else:
            peak, over, seconds = (
                f"{case['peak_rss'] / 2**30:.2f}",
                f"+{case['peak_rss'] / state - 1:.0%}",
                f"{min(case['step_seconds']):.1f}",
            )
        lines.append(
            f"| {case['size']} | {case['vocab']:,} | {case['logprobs']} | {'on' if case['checkpointing'] else 'off'} | {peak} | "
            f"{state / 2**30:.2f} | {over} | {4 * case['vocab'] * r['tokens'] / 2**30:.2f} | {seconds} |"
        )
    return "\n".join(lines)


def scale_loop_text() -> str:
    """The loop at each size, per step, with TRL beside it (bench_scale.py)."""
    record = _load("scale")
    if not record:
        return "_not measured yet: python -m bench.bench_scale_"
    r = record["result"]
    lines = [
        f"The repeat task, {r['prompts_per_step']} prompts x {r['task']['env_config']['group_size']} samples of up to "
        f"{r['task']['env_config']['max_tokens']} tokens a step, {r['steps']} steps, lr {r['lr']} ({_measured(record)}). "
        "Medians over the steps after the first: wall seconds from one step's end to the next's (both sides), "
        "and clotho's parts, whose sum is in brackets (a reload may overlap the resume state's save); shares are of that sum. "
        "clotho publishes every step (in full every trainer.full_every, 10, and as deltas between: delta / full bytes) "
        "and saves its resume state every 10 minutes and at the last step: its seconds are those of one save; "
        "publish + state + reload counts one save spread over the steps of 10 minutes. "
        "The loop runs at max_lag 0 (on-policy, as TRL's step; its parts one after another); the last column is "
        "`clotho run` at the pipeline's default max_lag 1, a step's groups sampled while the step before trains.",
        "",
        "| size | vocab | clotho s / step (parts) | sampling | update | publish s (MB) | delta / full bytes | resume "
        "state s (MB) | reload s | publish + state + reload | trainer peak RSS GiB | TRL s / step | clotho / TRL | "
        "clotho at max_lag 1: s / step (/ TRL) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in r["sizes"]:
        clotho, trl = entry.get("clotho", {}), entry.get("trl", {})
        if "step_s" in clotho:
            parts, shares = clotho["parts_s"], clotho["shares"]
            overhead = clotho.get("overhead_share", shares["publish_s"] + shares["save_state_s"] + shares["reload_s"])
            state_mb = f"{clotho['state_bytes'] / 1e6:,.0f}" if clotho.get("state_bytes") else "-"
            cells = [
                f"{clotho['wall_step_s']:.2f} ({clotho['step_s']:.2f})",
                f"{parts['sampling_s']:.2f} ({shares['sampling_s']:.0%})",
                f"{parts['update_s']:.2f} ({shares['update_s']:.0%})",
                f"{parts['publish_s']:.2f} ({clotho['publish_bytes'] / 1e6:,.0f})",
                f"{clotho['delta_fraction']:.1%}" if clotho.get("delta_fraction") else "-",
                f"{clotho.get('state_save_s', parts['save_state_s']):.2f} ({state_mb})",
                f"{parts['reload_s']:.2f}",
                f"{overhead:.0%}",
                f"{clotho['trainer_peak_rss_gib']:.2f}",
            ]
        else:
            cells = [clotho.get("error", "not run")[:60]] + ["-"] * 8
        cells.append(f"{trl['step_s']:.2f}" if "step_s" in trl else trl.get("error", "not run")[:60])
        cells.append(f"{entry['ratio']:.3f}" if "ratio" in entry else "-")
        lag1 = entry.get("clotho-lag1", {})
        cells.append(
            f"{lag1['wall_step_s']:.2f} ({entry['ratio_lag1']:.3f})"
            if "ratio_lag1" in entry
            else lag1.get("error", "-")[:60]
        )
        lines.append(f"| {entry['size']} | {entry['vocab']:,} | " + " | ".join(cells) + " |")
    floors = [entry for entry in r["sizes"] if "floor" in entry]
    if floors:
        lines += [
            "",
            "Sampling a step's groups without the loop (bench_scale.sampling_floor): the step's requests straight to a "
            "vLLM server in the loop's dtype, and the same batch through transformers' `generate` in fp32 as TRL samples "
            "here, every sample exactly max_tokens long; beside them the loop's sampling part and TRL's whole step. Where "
            "the server alone takes longer than TRL's whole step, clotho / TRL <= 1 cannot be met at that size while a "
            "vLLM server samples.",
            "",
            "| size | loop's sampling s | vLLM server alone s | transformers generate s | TRL s / step |",
            "|---|---|---|---|---|",
        ]
        for entry in floors:
            floor, clotho, trl = entry["floor"], entry.get("clotho", {}), entry.get("trl", {})
            sampling = f"{clotho['parts_s']['sampling_s']:.2f}" if "parts_s" in clotho else "-"
            trl_s = f"{trl['step_s']:.2f}" if "step_s" in trl else "-"
            lines.append(
                f"| {entry['size']} | {sampling} | {floor['served_s']:.2f} ({floor['dtype']}) | {floor['generate_s']:.2f} | {trl_s} |"
            )
    parities = [entry for entry in r["sizes"] if "same_fp32" in entry.get("parity", {})]
    if parities:
        lines += [
            "",
            "The parity guard's noise (bench_scale.parity_noise): |served - reference| logprobs of its prompts, max "
            "(mean), with the server in the loop's dtype, against the reference a trainer stores with a checkpoint "
            "(computed as published: in bf16), against an fp32 forward of the same weights (the guard's reference for "
            "an outside model), and against the stored reference of the same shape built from another seed (wrong "
            "weights, which the tolerance must catch).",
            "",
            "| size | dtype | same weights, stored reference | same weights, fp32 forward | another seed's | tolerance |",
            "|---|---|---|---|---|---|",
        ]
        for entry in parities:
            parity = entry["parity"]
            cells = [f"{parity[key]['max']:.3f} ({parity[key]['mean']:.4f})" for key in ("same", "same_fp32", "other")]
            lines.append(
                f"| {entry['size']} | {parity['dtype']} | " + " | ".join(cells) + f" | {parity['tolerance']} |"
            )
    return "\n".join(lines)


def cost_model_text() -> str:
    """bench_scale.py's extrapolation of each term of a step to Qwen2.5-7B."""
    record = _load("scale")
    model = record["result"].get("cost_model_7b") if record else None
    if not model:
        return "_no cost model yet: python -m bench.bench_scale_"
    target, node = model["target"], model["node_assumptions"]
    names = {
        "sampling_s": "sampling",
        "update_s": "update",
        "publish_s": "publish (bf16)",
        "save_state_s": "resume state",
        "reload_s": "reload",
    }
    rates = model["rates"]
    lines = [
        f"Each term extrapolated to Qwen2.5-7B ({target['parameters'] / 1e9:.2f}B parameters) at a step of {target['sequences']} "
        f"sequences of ~{target['tokens']} tokens ({target['sampled']} sampled), from the rates clotho measured at the "
        f"{model['from_size']} shape: update {rates['update_flops_per_s'] / 1e9:.0f} GFLOP/s (8 x parameters x tokens), "
        f"publish {rates['publish_s_per_parameter'] * 1e9:.2f} s per billion parameters, resume state "
        f"{rates['state_bytes_per_s'] / 1e6:.0f} MB/s, reload {rates['reload_s_per_parameter'] * 1e9:.2f} s per billion "
        "parameters (publish and reload as a step did them: a full checkpoint every trainer.full_every, deltas between). "
        f"The node column assumes (no GPU here) {node['gpus']} GPUs of "
        f"{node['peak_flops_per_gpu'] / 1e12:.0f} TFLOP/s bf16 at {node['mfu']:.0%} MFU, {node['sampling_gpus']} of them sampling "
        f"{node['decode_tokens_per_s_per_gpu']:,.0f} tokens/s each, and {node['disk_bytes_per_s'] / 1e9:.0f} GB/s of disk.",
        "",
        "| term | this machine s | share | 8-GPU node s | share |",
        "|---|---|---|---|---|",
    ]
    here, gpu = model["this_machine"], model["node"]
    for key, name in names.items():
        lines.append(
            f"| {name} | {here['parts_s'][key]:,.1f} | {here['shares'][key]:.0%} | {gpu['parts_s'][key]:,.1f} | {gpu['shares'][key]:.0%} |"
        )
    lines.append(
        f"| **step** | {here['step_s']:,.0f} | dominant: {names[here['dominant']]} | {gpu['step_s']:,.1f} | "
        f"dominant: {names[gpu['dominant']]} |"
    )
    if "state" in gpu:
        lines += [
            "",
            f"The resume state is written once every {model.get('state_every_minutes', 10):g} minutes (trainer.state_every_minutes): "
            f"one takes {here['state']['one_s']:,.0f} s here and {gpu['state']['one_s']:,.0f} s on the node's disk, shared by the "
            f"{here['state']['steps_per_state']} and {gpu['state']['steps_per_state']} steps between two; its upload to remote "
            "storage runs beside the steps.",
        ]
    return "\n".join(lines)


def scale_block() -> str:
    return f"{SCALE_START}\n{scale_loop_text()}\n\n{cost_model_text()}\n\n{scale_memory_text()}\n{SCALE_END}"


def demo_block() -> str:
    return f"{DEMO_START}\n{demo_text()}\n{DEMO_END}"


def listing_block() -> str:
    """The README's listing of the reference environment: the file as committed, never a copy."""
    return f"{LISTING_START}\n```python\n{(REPO / LISTED).read_text()}```\n{LISTING_END}"


def demo_config_sha(name: str) -> str:
    import hashlib

    return hashlib.sha256(DEMO_CONFIGS[name].read_bytes()).hexdigest()[:12]


def record_demo(summary_path: Path) -> None:
    """bench/results/demo.json (demo-tiny.json for `clotho demo --tiny`) from a demo's summary: the
    curve, the verdict, the stop, minutes and sampled completions; and one line per demo recorded
    with the same config (`runs`), this one last, so the README shows the newest run and how the
    others went, not the best one."""
    from bench.results import current_commit, utc_now, write_result

    summary = json.loads(summary_path.read_text())
    kept = (
        "steps",
        "minutes",
        "demo_minutes",
        "curve",
        "verdict",
        "stopped_by_rule",
        "best",
        "groups_sampled",
        "groups_trained",
        "reload_s_median",
        "completions",
    )
    name = "demo-tiny" if summary.get("tiny") else "demo"
    sha, earlier = demo_config_sha(name), _load(name)
    runs = earlier["result"].get("runs", []) if earlier and earlier["result"].get("config_sha") == sha else []
    verdict = summary["verdict"]
    runs.append(
        {
            "measured_at": utc_now(),
            "commit": current_commit(),
            "steps": summary["steps"],
            "sft_plateau": round(verdict["sft_plateau"], 3),
            "end": round(verdict["end"], 3),
            "rl_gain": round(verdict["rl_gain"], 3),
            "criterion_met": verdict["criterion_met"],
            "stopped_by_rule": bool(summary.get("stopped_by_rule")),
            "demo_minutes": round(summary.get("demo_minutes", summary["minutes"]), 1),
        }
    )
    write_result(
        name,
        {
            "command": "clotho demo --tiny" if name == "demo-tiny" else "make demo",
            **{key: summary[key] for key in kept if key in summary},
            "config_sha": sha,
            "runs": runs,
        },
    )


def replace_block(text: str, start: str, end: str, block: str, where: Path = README) -> str:
    if start not in text or end not in text:
        sys.exit(f"{where} has no markers {start} ... {end}")
    before, rest = text.split(start, 1)
    return before + block + rest.split(end, 1)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readme", action="store_true", help="rewrite the blocks of the README and docs/benchmarks.md")
    parser.add_argument(
        "--record-demo",
        nargs="?",
        const=DEMO_SUMMARY,
        type=Path,
        metavar="SUMMARY",
        help="keep a demo's summary.json as bench/results/demo.json",
    )
    args = parser.parse_args()
    if args.record_demo:
        record_demo(args.record_demo)
    if not args.readme:
        print(markdown() + "\n\n" + demo_text() + "\n\n" + peer_text())
        return
    text = replace_block(BENCHMARKS.read_text(), START, END, bench_block(), BENCHMARKS)
    text = replace_block(text, PEER_START, PEER_END, peer_block(), BENCHMARKS)
    text = replace_block(text, SAMPLING_START, SAMPLING_END, sampling_block(), BENCHMARKS)
    BENCHMARKS.write_text(replace_block(text, SCALE_START, SCALE_END, scale_block(), BENCHMARKS))
    text = replace_block(README.read_text(), DEMO_START, DEMO_END, demo_block())
    README.write_text(replace_block(text, LISTING_START, LISTING_END, listing_block()))
    print(f"{BENCHMARKS.relative_to(REPO)} tables and the README's demo figures and listing rewritten")


if __name__ == "__main__":
    main()

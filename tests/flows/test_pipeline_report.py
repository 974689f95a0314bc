"""The pipeline's own measurements: reload times per version, phases, evaluations, staleness."""

from __future__ import annotations

import asyncio
import json

from flows.pipeline_report import PipelineLog, StepLog, progress_line, significant, staleness_table
from inference.watcher import ReloadOutcome
from storage.progress import write_step_metrics


def test_reload_times_are_the_slowest_server_per_version_and_join_the_step_table(tmp_path):
    measured = PipelineLog(tmp_path)
    outcomes = [
        ReloadOutcome("http://a", 1, "reloaded", "", swap_s=0.1, parity_s=0.2, total_s=0.5),
        ReloadOutcome("http://b", 1, "reloaded", "", swap_s=0.1, parity_s=0.3, total_s=0.7),
        ReloadOutcome("http://a", 1, "failed", "boom"),  # no time: not a reload
        ReloadOutcome("http://a", 2, "reloaded", "", swap_s=0.1, parity_s=0.1, total_s=0.4),
    ]
    asyncio.run(measured.reloads(outcomes))
    measured.phase("rl", 2)
    measured.evaluation({"phase": "rl", "step": 2, "reward": 0.5, "minutes": 1.0})
    measured.close()
    assert measured.reload_s == {1: 0.7, 2: 0.4}
    assert measured.summary() == {"reloads": 2, "reload_s_median": 0.7, "reload_s_max": 0.7}
    events = [json.loads(line) for line in (tmp_path / "pipeline.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["reload", "reload", "reload", "phase", "evaluation"]
    assert any(path.name.startswith("events.out.tfevents") for path in (tmp_path / "tensorboard").iterdir())

    rows = [
        {"step": 1, "score_mean": 0.25, "staleness/0": 2, "time": 1.0},
        {"step": 2, "staleness/0": 1, "staleness/1": 3, "time": 2.0},
    ]
    for row in rows:
        write_step_metrics(f"file://{tmp_path}", "run", row)
    steps = StepLog(f"file://{tmp_path}", "run", since=0.0)
    steps.new()
    table = steps.table(measured.reload_s)
    assert [row["step"] for row in table] == [2, 1] and [row["reload_s"] for row in table] == [0.4, 0.7]  # newest first
    assert list(table[0]) == [
        "step",
        "score_mean",
        "groups_per_s",
        "reload_s",
    ]  # the watched columns only: no epoch time
    assert steps.staleness_histogram() == {"0": 3, "1": 3}
    assert staleness_table(steps.staleness_histogram()) == [
        {"versions_behind": 0, "groups": 3, "share": 0.5},
        {"versions_behind": 1, "groups": 3, "share": 0.5},
    ]


def test_numbers_in_the_tables_keep_four_significant_digits():
    assert [significant(v) for v in (0.123456789, 1234.5678, 3, None, 0.0, -0.00098765)] == [
        0.1235,
        1235.0,
        3,
        None,
        0.0,
        -0.0009877,
    ]


def test_the_step_line_says_step_of_total_and_time_left(tmp_path):
    steps = StepLog(f"file://{tmp_path}", "run", since=0.0)
    assert steps.seconds_per_step() is None
    for s in range(1, 5):
        write_step_metrics(f"file://{tmp_path}", "run", {"step": s, "time": 100.0 + 3 * s, "score_mean": 0.5})
    steps.new()
    assert steps.seconds_per_step() == 3.0
    line = progress_line("rl", steps.rows[-1], 90.0, 24, steps.seconds_per_step())
    assert line.startswith("[rl] step 4/24 reward 0.500 policy v0") and line.endswith(
        "(1.5 min, ~1.0 min left at most)"
    )
    assert progress_line("rl", {"step": 24}, 90.0, 24, 3.0).endswith("(1.5 min)")


def test_the_step_log_reads_this_trainers_steps_from_storage_in_order(tmp_path):
    """What `clotho run` follows on any host: the rows after the step the run resumed at, each
    once, in step order; a row an earlier trainer wrote for a step trained again is waited for
    until this trainer writes it."""
    storage = f"file://{tmp_path}"
    for step in (1, 2, 3):
        write_step_metrics(storage, "run", {"step": step, "time": 10.0 + step})  # an earlier trainer's
    steps = StepLog(storage, "run", after_step=2, since=100.0)
    assert steps.new() == []  # step 3 is the earlier trainer's: not yet this one's
    write_step_metrics(storage, "run", {"step": 3, "time": 101.0})
    write_step_metrics(storage, "run", {"step": 5, "time": 105.0})  # step 4 not written yet
    assert [row["step"] for row in steps.new()] == [3]
    write_step_metrics(storage, "run", {"step": 4, "time": 103.0, "groups_consumed": 8})
    assert [row["step"] for row in steps.new()] == [4, 5] and steps.new() == []
    assert steps.last_step == 5

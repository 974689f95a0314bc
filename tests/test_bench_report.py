"""The benchmark tables (docs/benchmarks.md), the README's demo figures and its environment listing
are what bench/report.py renders from bench/results/*.json and the listed file: numbers and code
are never typed into the README or the docs by hand."""

import importlib
import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def bench_report():
    return importlib.import_module("bench.report")


@pytest.mark.parametrize(
    "page, block, source",
    [
        ("docs/benchmarks.md", "bench_block", "bench/results/*.json"),
        ("docs/benchmarks.md", "peer_block", "bench/results/peer.json"),
        ("docs/benchmarks.md", "sampling_block", "bench/results/sampling.json"),
        ("docs/benchmarks.md", "scale_block", "bench/results/scale_memory.json"),
        ("README.md", "demo_block", "bench/results/demo.json"),
        ("README.md", "listing_block", "environments/bundled/capitals.py"),
    ],
)
def test_numbers_and_listings_are_rendered_from_their_source(page, block, source):
    assert getattr(bench_report(), block)() in (REPO / page).read_text(), (
        f"{page}'s {block} differs from {source}: run `python -m bench.report --readme`"
    )


def test_a_recorded_demo_keeps_every_run_of_the_same_config_and_shows_the_newest(tmp_path, monkeypatch):
    report = bench_report()
    from bench import results

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    configs = {"demo": tmp_path / "real.yaml", "demo-tiny": tmp_path / "demo.yaml"}
    for config in configs.values():
        config.write_text("phases: []\n")
    monkeypatch.setattr(report, "DEMO_CONFIGS", configs)
    curve = [
        {"phase": "sft", "step": 0, "reward": 0.0, "minutes": 1.0},
        {"phase": "rl", "step": 9, "reward": 0.7, "train_reward": 0.6, "minutes": 3.0},
    ]
    summary = tmp_path / "summary.json"

    def record(gain: float, met: bool) -> None:
        verdict = {
            "start": 0.0,
            "sft_plateau": 0.4,
            "end": 0.4 + gain,
            "rl_gain": gain,
            "criterion_met": met,
            "window": 3,
        }
        summary.write_text(
            json.dumps(
                {"steps": 9, "minutes": 3.0, "demo_minutes": 3.5, "curve": curve, "verdict": verdict, "tiny": True}
            )
        )
        report.record_demo(summary)

    record(0.5, True)
    assert "demos recorded" not in report.demo_text()  # one run: nothing to sum up
    assert report.demo_text().startswith("No demo run is recorded yet")  # `make demo`'s: none yet
    record(0.1, False)
    text = report.demo_text()
    assert "0.50 at step 9 after RL" in text  # the newest run, not the best one
    assert (
        "All 2 demos recorded with this `runs/demo.yaml`, oldest first: RL added over the SFT plateau +0.50, +0.10"
        in text
        and "1 of 2 met" in text
    )
    configs["demo-tiny"].write_text("phases: [changed]\n")  # another config: its runs start a new history
    record(0.3, True)
    assert len(json.loads((tmp_path / "demo-tiny.json").read_text())["result"]["runs"]) == 1
    # The real demo: pure RL from the model's own start, its sampled completions shown.
    real = [
        {"phase": "rl", "step": 0, "reward": 0.27, "minutes": 0.6, "seconds": 9.0, "items": 51},
        {"phase": "rl", "step": 5, "reward": 0.76, "minutes": 3.4, "seconds": 4.0, "items": 51},
    ]
    row = {"env": "arithmetic", "policy_version": 0, "finish_reason": "stop", "prompt": "What is 7 * 8?"}
    summary.write_text(
        json.dumps(
            {
                "steps": 5,
                "minutes": 3.5,
                "demo_minutes": 4.0,
                "curve": real,
                "verdict": {"start": 0.27, "sft_plateau": 0.27, "end": 0.76, "rl_gain": 0.49, "criterion_met": True},
                "completions": {
                    "first": [{**row, "completion": "To solve this problem, we", "score": 0.0}],
                    "last": [{**row, "completion": "56", "score": 1.2}],
                },
            }
        )
    )
    report.record_demo(summary)
    text = report.demo_text()
    assert "held-out problems 0.27 at the start (the model's own), 0.76 at step 5 (its last evaluation), +0.49" in text
    assert "+0.30 first reached at step 5, 3.4 minutes in" in text and "answered in 4-9 s" in text
    assert '"What is 7 * 8?" → "56" (score 1.20)' in text
    assert text.index("held-out problems") < text.index("`clotho demo --tiny`")  # the real demo first


def test_the_peer_bench_counts_time_from_the_first_step_without_the_peer_s_saves():
    peer = importlib.import_module("bench.bench_peer")
    # Steps end every 2 s; step 2's checkpoint took 5 s more, which a TRL user would not pay.
    side = {
        "started": 90.0,
        "steps": [
            {"step": 1, "time": 100.0},
            {"step": 2, "time": 102.0},
            {"step": 3, "time": 109.0},
            {"step": 4, "time": 111.0},
        ],
        "saves": {2: 5.0},
    }
    times = peer.timeline(side)
    assert times["seconds_per_step"] == 2.0
    assert times["elapsed"] == {1: 2.0, 2: 4.0, 3: 6.0, 4: 8.0}  # the first step counts as a median one
    assert times["startup_s"] == 8.0


def test_the_scale_memory_probe_measures_a_trainer_step_in_a_process_of_its_own(tmp_path, monkeypatch):
    bench = importlib.import_module("bench.bench_scale_memory")
    monkeypatch.setattr(bench, "MODELS", tmp_path)
    case = bench.run_case("tiny", 1024, "chunked", True, "float32", steps=1, limit=300, max_rss=8 * 2**30)
    assert case["parameters"] == 427_136 and case["micro_batches"] == 1 and case["tokens"] == 1024
    assert 0 < case["peak_rss"] < 8 * 2**30 and len(case["step_seconds"]) == 1
    assert bench.run_case("tiny", 1024, "whole", False, "float32", steps=1, limit=300, max_rss=2**20) == {
        "error": "over 0 GiB of RSS"
    }


def test_the_scale_cost_model_extrapolates_each_term_by_its_own_rate():
    bench = importlib.import_module("bench.bench_scale")
    parts = {"sampling_s": 4.0, "update_s": 40.0, "publish_s": 10.0, "save_state_s": 20.0, "reload_s": 5.0}
    entry = {
        "size": "qwen2.5-0.5b",
        "parameters": 5e8,
        "clotho": {
            "parts_s": parts,
            "publish_bytes": 1e8,
            "full_bytes": 1e9,
            "state_bytes": 8e9,
            "state_save_s": 20.0,
            "tokens_per_step": 2000,
            "sampled_tokens_per_step": 1000,
        },
    }
    model = bench.cost_model(entry)
    big, target = bench.QWEN25_7B["parameters"], bench.QWEN25_7B
    here = model["this_machine"]["parts_s"]
    # Each term at its own measured rate: 8 P T FLOPs, P x sampled tokens, publish and reload by the
    # parameters, 16 bytes a parameter.
    assert here["update_s"] == round(40.0 * (big * target["sequences"] * target["tokens"]) / (5e8 * 2000), 3)
    assert here["sampling_s"] == round(4.0 * (big * target["sequences"] * target["sampled"]) / (5e8 * 1000), 3)
    # The state once every STATE_EVERY_MINUTES: one state's seconds over the steps between two.
    one_state = 16 * big / (8e9 / 20.0)
    steps_per_state = model["this_machine"]["state"]["steps_per_state"]
    other = sum(v for k, v in here.items() if k != "save_state_s")
    assert steps_per_state == max(1, math.ceil(bench.STATE_EVERY_MINUTES * 60 / other))
    node = model["node"]
    assert node["state"]["steps_per_state"] > 1 and node["parts_s"]["save_state_s"] < node["state"]["one_s"] / 2
    assert (
        here["publish_s"] == round(10.0 * big / 5e8, 3)
        and abs(here["save_state_s"] - one_state / steps_per_state) < 1e-3
    )
    assert here["reload_s"] == round(5.0 * big / 5e8, 3)
    # On the node, publish and reload move the share of the bf16 weights a step wrote here (a tenth).
    disk = bench.NODE["disk_bytes_per_s"]
    assert (
        model["node"]["parts_s"]["publish_s"] == round(2 * big * 0.1 / disk, 3) == model["node"]["parts_s"]["reload_s"]
    )
    for column in ("this_machine", "node"):
        shares = model[column]["shares"]
        assert abs(sum(shares.values()) - 1) < 0.01 and model[column]["dominant"] == max(shares, key=shares.get)

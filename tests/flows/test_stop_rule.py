"""The pipeline's stop rule (phases[].stop) and the curve's training reward, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flows.pipeline import with_training_reward
from flows.pipeline_config import PipelineConfig, StopRule

PHASE = {"environments": [{"env": "compare"}]}


@pytest.mark.parametrize(
    "rewards, met",
    [
        ([], False),
        ([0.5, 0.7, 0.92], False),  # reached, still rising
        ([0.5, 0.92, 0.9, 0.92], False),  # two evaluations without a new best, patience 3
        ([0.5, 0.92, 0.9, 0.92, 0.89], True),
        ([0.5, 0.92, 0.9, 0.95, 0.9, 0.9], False),  # a new best starts the count again
        ([0.8, 0.85, 0.85, 0.85, 0.85], False),  # stopped rising below the target: keep training
    ],
)
def test_the_rule_needs_the_target_and_patience_evaluations_without_a_new_best(rewards, met):
    assert StopRule(reward=0.9, patience=3).met(rewards) is met


def test_min_delta_counts_a_small_rise_as_no_rise():
    assert StopRule(reward=0.9, patience=2, min_delta=0.05).met([0.9, 0.93, 0.94])
    assert not StopRule(reward=0.9, patience=2).met([0.9, 0.93, 0.94])


def test_a_window_reads_the_running_mean_so_one_lucky_evaluation_neither_ends_nor_holds_the_run():
    rule = StopRule(reward=0.6, patience=2, window=3)
    assert rule.smoothed([0.3, 0.6, 0.9, 0.3]) == pytest.approx([0.6, 0.6])
    lucky = [0.45, 0.5, 0.7, 0.45, 0.5, 0.5]  # one evaluation reaches 0.6, the curve does not
    assert StopRule(reward=0.6, patience=2).met(lucky) and not rule.met(lucky)
    learned = [0.5, 0.6, 0.7, 0.7, 0.7, 0.7, 0.7]  # the running mean rises to 0.7, then two means stay there
    assert not rule.met(learned[:6]) and rule.met(learned)
    # The same mean of other evaluations (0.6 + 0.7 + 0.8, then 0.7 + 0.8 + 0.6) is no new best, whatever its rounding.
    assert rule.met([0.6, 0.7, 0.8, 0.6, 0.7])
    assert rule.describe() == "held-out reward (mean of 3 evaluations) >= 0.6 reached and no new best in 2 evaluations"


def config(**fields) -> dict:
    return {
        "run": "file:///tmp/x/run",
        "model": "m",
        "phases": [{"name": "sft", "steps": 2, **PHASE}, {"name": "rl", "steps": 3, **PHASE}],
        "evaluation": {"env": "compare"},
        **fields,
    }


def test_only_the_last_phase_may_stop_early_and_only_with_an_evaluation():
    settings = config()
    settings["phases"][1]["stop"] = {"reward": 0.9}
    assert PipelineConfig.model_validate(settings).phases[1].stop.patience == 2
    settings["phases"][0]["stop"] = {"reward": 0.9}
    with pytest.raises(ValidationError, match="phases.0.stop: only the last phase"):
        PipelineConfig.model_validate(settings)
    settings = config(evaluation=None)
    settings["phases"][1]["stop"] = {"reward": 0.9}
    with pytest.raises(ValidationError, match="phases.1.stop: the rule reads the evaluation curve"):
        PipelineConfig.model_validate(settings)


def test_each_evaluation_gets_the_mean_training_reward_of_the_steps_since_the_one_before():
    curve = [
        {"phase": "sft", "step": 0, "reward": 0.0},
        {"phase": "sft", "step": 2, "reward": 0.4},
        {"phase": "rl", "step": 4, "reward": 0.6},
        {"phase": "rl", "step": 5, "reward": 0.7},
    ]
    steps = [
        {"step": 1, "sft/nll": 2.0},
        {"step": 2, "sft/nll": 1.0},
        {"step": 3, "score_mean": 0.25},
        {"step": 4, "score_mean": 0.75},
        {"step": 5, "score_mean": 0.5},
    ]
    assert [row["train_reward"] for row in with_training_reward(curve, steps)] == [None, None, 0.5, 0.5]

"""Group-normalized advantages and the per-token override."""

from __future__ import annotations

import pytest

from core.advantages import group_advantages as advantages_of
from core.scored_group import ScoredGroup, ScoredSequence
from trainer.advantages import sequence_token_advantages
from trainer.config import AdvantageConfig


def group_advantages(scores, config: AdvantageConfig) -> list[float]:
    """core.advantages.group_advantages as the trainer calls it, with its config's mode and eps."""
    return advantages_of(scores, config.mode, config.eps)


def test_grpo_normalizes_by_mean_and_population_std():
    # mean 0.5, population std 0.5: (1 - 0.5) / (0.5 + 1e-6) etc.
    unit = 0.5 / (0.5 + 1e-6)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], AdvantageConfig()) == pytest.approx([unit, -unit, -unit, unit])


def test_grpo_by_hand_uneven():
    # scores 3, 1, 2: mean 2, deviations 1, -1, 0, population std sqrt(2/3) = 0.816497.
    result = group_advantages([3.0, 1.0, 2.0], AdvantageConfig(eps=0.0001))
    std = (2 / 3) ** 0.5
    assert result == pytest.approx([1 / (std + 0.0001), -1 / (std + 0.0001), 0.0])


def test_mean_only_just_centers():
    assert group_advantages([3.0, 1.0, 2.0], AdvantageConfig(mode="mean_only")) == pytest.approx([1.0, -1.0, 0.0])


def test_leave_one_out_subtracts_the_mean_of_the_others():
    # 3 - (1 + 2) / 2 = 1.5, 1 - (3 + 2) / 2 = -1.5, 2 - (3 + 1) / 2 = 0
    assert group_advantages([3.0, 1.0, 2.0], AdvantageConfig(mode="leave_one_out")) == pytest.approx([1.5, -1.5, 0.0])


@pytest.mark.parametrize("mode", ["grpo", "mean_only", "leave_one_out"])
def test_no_signal_gives_zeros(mode):
    config = AdvantageConfig(mode=mode)
    assert group_advantages([0.7, 0.7, 0.7], config) == [0.0, 0.0, 0.0]
    assert group_advantages([0.3], config) == [0.0]
    assert group_advantages([], config) == []


def group(override=None):
    def sequence(score, advantages=None):
        return ScoredSequence.from_prompt([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], score, advantages=advantages)

    return ScoredGroup(env="test", item_id="0", sequences=[sequence(1.0), sequence(0.0, override), sequence(0.5)])


def test_sequence_advantages_sit_on_trained_tokens_only():
    # mean_only: scores 1, 0, 0.5 -> advantages 0.5, -0.5, 0; prompts (2 tokens) get 0.
    result = sequence_token_advantages(group(), AdvantageConfig(mode="mean_only"))
    assert result == [[0, 0, 0.5, 0.5, 0.5], [0, 0, -0.5, -0.5, -0.5], [0, 0, 0, 0, 0]]


def test_override_replaces_only_its_sequence():
    # The override's values at untrained positions (9.0) are dropped; siblings keep the advantages
    # computed from all three scores.
    override = [9.0, 9.0, 1.0, 2.0, 3.0]
    result = sequence_token_advantages(group(override), AdvantageConfig(mode="mean_only"))
    assert result == [[0, 0, 0.5, 0.5, 0.5], [0, 0, 1.0, 2.0, 3.0], [0, 0, 0, 0, 0]]

"""Trainer config: per-loss defaults, validation messages, YAML with key=value overrides."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from trainer.config import LossConfig, TrainerConfig, apply_overrides


def test_clip_defaults_follow_the_loss():
    assert (LossConfig().clip_low, LossConfig().clip_high) == (0.2, 0.2)
    assert LossConfig(name="dapo").clip_high == 0.28
    assert (LossConfig(name="gspo").clip_low, LossConfig(name="gspo").clip_high) == (3e-4, 4e-4)
    assert LossConfig(name="dapo", clip_high=0.3).clip_high == 0.3


def test_cap_inside_the_clip_range_is_refused():
    with pytest.raises(ValidationError, match="importance_cap: 1.1 < 1 \\+ clip_high"):
        LossConfig(name="dapo", importance_cap=1.1)
    assert LossConfig(importance_cap=None).importance_cap is None


def test_dr_grpo_defaults_to_mean_only_advantages():
    assert TrainerConfig(model="m", loss={"name": "dr_grpo"}).advantages.mode == "mean_only"
    assert TrainerConfig(model="m").advantages.mode == "grpo"
    explicit = TrainerConfig(model="m", loss={"name": "dr_grpo"}, advantages={"mode": "grpo"})
    assert explicit.advantages.mode == "grpo"


def test_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: tiny\nlr: 3.0e-6\nloss:\n  name: grpo\n")
    config = TrainerConfig.from_yaml(
        path, ["loss.name=dapo", "lr=1e-5", "grad_clip=null", "advantages.eps=1e-4"]
    )
    assert config.model == "tiny" and config.lr == 1e-5 and config.grad_clip is None
    assert config.loss.name == "dapo" and config.loss.clip_high == 0.28
    assert config.advantages.eps == 1e-4
    assert TrainerConfig.from_yaml(None, ["model=other"]).model == "other"


def test_unknown_fields_and_bad_values_are_named():
    with pytest.raises(ValidationError, match="loss.clip_hi"):
        TrainerConfig.from_yaml(None, ["model=m", "loss.clip_hi=0.3"])
    with pytest.raises(ValidationError, match="micro_batch_tokens"):
        TrainerConfig.from_yaml(None, ["model=m", "micro_batch_tokens=0"])


def test_malformed_overrides():
    with pytest.raises(ValueError, match="write it as key=value"):
        apply_overrides({}, ["lr"])
    with pytest.raises(ValueError, match="lr is a value, not a section"):
        apply_overrides({"lr": 1.0}, ["lr.x=2"])
    original = {"loss": {"name": "grpo"}}
    assert apply_overrides(original, ["loss.name=gspo"]) == {"loss": {"name": "gspo"}}
    assert original == {"loss": {"name": "grpo"}}


def test_config_imports_nothing_heavy():
    code = "import sys, trainer.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)

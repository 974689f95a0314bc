"""Trainer config: losses by name or import path, per-loss defaults, validation messages, YAML with
key=value overrides."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from core.overrides import apply_overrides
from tests.trainer import custom_loss
from trainer import corrections, losses
from trainer.config import BUILTIN_LOSSES, LossConfig, TrainerConfig

CUSTOM = "tests.trainer.custom_loss"


def test_clip_defaults_follow_the_loss():
    assert (LossConfig().clip_low, LossConfig().clip_high) == (0.2, 0.2)
    assert LossConfig(name="dapo").clip_high == 0.28
    assert (LossConfig(name="gspo").clip_low, LossConfig(name="gspo").clip_high) == (3e-4, 4e-4)
    assert LossConfig(name="dapo", clip_high=0.3).clip_high == 0.3


def test_a_built_in_name_is_short_for_its_import_path():
    for name, path in BUILTIN_LOSSES.items():
        assert LossConfig(name=name).function is LossConfig(name=path).function
        module = corrections if path.startswith("trainer.corrections:") else losses
        assert LossConfig(name=path).function is getattr(module, name)
    assert LossConfig(name="trainer.losses:dapo").clip_high == 0.28


def test_a_custom_loss_is_imported_with_its_own_defaults():
    config = TrainerConfig(model="m", loss={"name": f"{CUSTOM}:wide_clip_grpo"})
    assert config.loss.function is custom_loss.wide_clip_grpo
    assert (config.loss.clip_low, config.loss.clip_high) == (0.2, 0.5)
    assert config.advantages.mode == "mean_only"
    plain = LossConfig(name=f"{CUSTOM}:reinforce", options={"scale": 2.0})
    assert (plain.clip_low, plain.clip_high, plain.options) == (0.2, 0.2, {"scale": 2.0})
    with pytest.raises(ValidationError, match="importance_cap: 1.2 < 1 \\+ clip_high \\(1.5"):
        LossConfig(name=f"{CUSTOM}:wide_clip_grpo", importance_cap=1.2)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "ppo",
            "loss.name: 'ppo' is neither a built-in loss \\(grpo, dr_grpo, dapo, gspo, mis_token, mis_sequence, icepop, cispo, dppo\\)",
        ),
        ("no_such_module:loss", "loss.name: 'no_such_module:loss': cannot import no_such_module"),
        ("trainer.losses:nope", "trainer.losses has no 'nope'"),
        (f"{CUSTOM}:NOT_A_LOSS", "NOT_A_LOSS is not a function but of type int"),
        (f"{CUSTOM}:badly_declared", "its loss_defaults is of type dict; set it to .*LossDefaults"),
    ],
)
def test_a_bad_loss_name_fails_when_the_config_loads(name, message):
    with pytest.raises(ValidationError, match=message):
        TrainerConfig.from_yaml(None, ["model=m", f"loss.name={name}"])


def test_cap_inside_the_clip_range_is_refused():
    with pytest.raises(ValidationError, match="importance_cap: 1.1 < 1 \\+ clip_high"):
        LossConfig(name="dapo", importance_cap=1.1)
    assert LossConfig(importance_cap=None).importance_cap is None


def test_dr_grpo_defaults_to_mean_only_advantages():
    assert TrainerConfig(model="m", loss={"name": "dr_grpo"}).advantages.mode == "mean_only"
    by_path = TrainerConfig(model="m", loss={"name": "trainer.losses:dr_grpo"})
    assert by_path.advantages.mode == "mean_only"
    assert TrainerConfig(model="m").advantages.mode == "grpo"
    explicit = TrainerConfig(model="m", loss={"name": "dr_grpo"}, advantages={"mode": "grpo"})
    assert explicit.advantages.mode == "grpo"


def test_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: tiny\nlr: 3.0e-6\nloss:\n  name: grpo\n")
    config = TrainerConfig.from_yaml(
        path,
        ["loss.name=dapo", "lr=1e-5", "grad_clip=null", "advantages.eps=1e-4", "loss.options.k=3"],
    )
    assert config.model == "tiny" and config.lr == 1e-5 and config.grad_clip is None
    assert config.loss.name == "dapo" and config.loss.clip_high == 0.28
    assert config.loss.options == {"k": 3}
    assert config.advantages.eps == 1e-4
    assert TrainerConfig.from_yaml(None, ["model=other"]).model == "other"


def test_unknown_fields_and_bad_values_are_named():
    with pytest.raises(ValidationError, match="loss.clip_hi"):
        TrainerConfig.from_yaml(None, ["model=m", "loss.clip_hi=0.3"])
    with pytest.raises(ValidationError, match="micro_batch_tokens"):
        TrainerConfig.from_yaml(None, ["model=m", "micro_batch_tokens=0"])


def test_malformed_overrides():
    with pytest.raises(ValueError, match="write it as key.path=value"):
        apply_overrides({}, ["lr"])
    with pytest.raises(ValueError, match="lr is a value, not a section"):
        apply_overrides({"lr": 1.0}, ["lr.x=2"])
    original = {"loss": {"name": "grpo"}}
    assert apply_overrides(original, ["loss.name=gspo"]) == {"loss": {"name": "gspo"}}
    assert original == {"loss": {"name": "grpo"}}


def test_config_imports_nothing_heavy():
    code = "import sys, trainer.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_resume_state_goes_with_a_published_checkpoint():
    every = TrainerConfig(model="m", save_every=2, steps=30)
    assert [every.state_due(step, 0.0) for step in (2, 4)] == [True, True]
    tenth = TrainerConfig(model="m", save_every=2, state_every=10, steps=30)
    assert [step for step in range(2, 31, 2) if tenth.state_due(step, 0.0)] == [10, 20, 30]
    timed = TrainerConfig(model="m", save_every=2, state_every_minutes=5, steps=30)
    assert not timed.state_due(2, 4.9) and timed.state_due(4, 5.0) and timed.state_due(30, 0.0)
    both = TrainerConfig(model="m", save_every=2, state_every=10, state_every_minutes=5, steps=30)
    assert both.state_due(10, 0.0) and both.state_due(6, 6.0) and not both.state_due(8, 1.0)
    with pytest.raises(ValidationError, match="state_every=5 is not a multiple of save_every=2.*set state_every to 4"):
        TrainerConfig(model="m", save_every=2, state_every=5)


def test_the_defaults_bound_a_real_runs_disk():
    """keep_last 3 by default; deltas only where they pay: a float32 publish is full every time
    (a delta of fp32 weights was 40% of them), one in 16 bits a delta between fulls every 10."""
    config = TrainerConfig(model="m")
    assert config.keep_last == 3 and config.full_every is None and config.gradient_checkpointing is None
    assert config.publish_full_every == 1
    assert TrainerConfig(model="m", publish_dtype="bfloat16").publish_full_every == 10
    assert TrainerConfig(model="m", dtype="bfloat16").publish_full_every == 10
    assert TrainerConfig(model="m", publish_dtype="bfloat16", full_every=4).publish_full_every == 4

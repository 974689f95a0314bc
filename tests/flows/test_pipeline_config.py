"""The pipeline's config: the bundled runs/*.yaml load, bad fields are named with the fix, phases
are found by version, and each phase's trainer gets the pipeline's k."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.pipeline_config import PipelineConfig

RUNS = Path(__file__).resolve().parents[2] / "runs"


@pytest.mark.parametrize("path", sorted(RUNS.glob("*.yaml")), ids=lambda p: p.name)
def test_the_bundled_runs_load(path):
    config = PipelineConfig.from_yaml(path)
    assert config.phases and all(phase.steps > 0 for phase in config.phases)


def test_phases_by_version_and_trainer_overrides():
    config = PipelineConfig.from_yaml(RUNS / "demo.yaml", ["max_lag=2", "phases.1.steps=10"])
    sft, rl = config.phases
    end = sft.steps
    assert [config.phase_of(v).name for v in (0, 1, end, end + 1, end + 10, 10**6)] == [
        "sft",
        "sft",
        "sft",
        "rl",
        "rl",
        "rl",
    ]
    overrides = config.trainer_overrides(rl)
    assert "max_lag=2" in overrides and "groups_per_step=8" in overrides and "lr=0.0005" in overrides
    assert "groups_per_step=16" in config.trainer_overrides(sft)


def test_bad_configs_name_the_field_and_the_fix(tmp_path):
    base = {
        "run": "file:///tmp/x/run",
        "model": "m",
        "phases": [{"name": "rl", "steps": 2, "environments": [{"env": "arithmetic"}]}],
    }
    PipelineConfig.model_validate(base)
    with pytest.raises(ValueError, match="max_lag.*the pipeline's"):
        PipelineConfig.model_validate({**base, "trainer": {"max_lag": 3}})
    with pytest.raises(ValueError, match="servers: count is 0 and no urls"):
        PipelineConfig.model_validate({**base, "servers": {"count": 0}})
    with pytest.raises(ValueError, match="phases"):
        PipelineConfig.model_validate({**base, "phases": []})
    with pytest.raises(ValueError, match="max_lag"):
        PipelineConfig.model_validate({**base, "max_lag": -1})
    path = tmp_path / "bad.yaml"
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match="top level is list"):
        PipelineConfig.from_yaml(path)


def test_sampling_the_trainer_cannot_score_is_refused_before_the_run_starts():
    def phase(config: dict, trainer: dict | None = None) -> dict:
        return {
            "run": "file:///tmp/x/run",
            "model": "m",
            "phases": [
                {
                    "name": "rl",
                    "steps": 2,
                    "environments": [{"env": "arithmetic", "config": config}],
                    "trainer": trainer or {},
                }
            ],
        }

    with pytest.raises(
        ValueError, match=r"phases.0.environments.0.config.top_p: 0.9 truncates .* or train them as sft"
    ):
        PipelineConfig.model_validate(phase({"top_p": 0.9, "temperature": 0.7}))
    with pytest.raises(ValueError, match=r"phases.0.environments.0.config.top_k: 20"):
        PipelineConfig.model_validate(phase({"top_k": 20}, {"objective": "distill"}))
    PipelineConfig.model_validate(
        phase({"top_p": 0.9}, {"objective": "sft"})
    )  # demonstrations read no sampler logprobs
    PipelineConfig.model_validate(phase({"top_p": 0.9, "temperature": 0.0}))  # greedy
    PipelineConfig.model_validate(phase({"temperature": 1.25}))


def test_overrides_index_lists():
    from core.overrides import apply_overrides

    data = {"phases": [{"steps": 1}, {"steps": 2}]}
    assert apply_overrides(data, ["phases.1.steps=50"]) == {"phases": [{"steps": 1}, {"steps": 50}]}
    assert data["phases"][1]["steps"] == 2  # a copy
    with pytest.raises(ValueError, match="phases.2: index a list of 2 with 0..1"):
        apply_overrides(data, ["phases.2.steps=5"])


def test_the_trainer_publishes_in_the_dtype_the_servers_serve():
    base = {
        "run": "file:///tmp/x/run",
        "model": "m",
        "phases": [{"name": "rl", "steps": 2, "environments": [{"env": "arithmetic"}]}],
    }
    config = PipelineConfig.model_validate({**base, "servers": {"dtype": "bfloat16"}})
    assert 'publish_dtype="bfloat16"' in config.trainer_overrides(config.phases[0])
    plain = PipelineConfig.model_validate(base)
    assert plain.trainer_fields(plain.phases[0])["publish_dtype"] == "float32"
    auto = PipelineConfig.model_validate({**base, "servers": {"dtype": "auto"}})
    assert "publish_dtype" not in auto.trainer_fields(auto.phases[0])  # not one the trainer publishes in
    with pytest.raises(
        ValueError, match=r"phases.0 trainer publish_dtype 'bfloat16': the servers serve 'float32'.*drop publish_dtype"
    ):
        PipelineConfig.model_validate({**base, "trainer": {"publish_dtype": "bfloat16"}})

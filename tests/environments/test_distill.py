"""On-policy distillation: any environment's samples scored by a teacher server, token by token."""

from __future__ import annotations

import asyncio

import pytest

from environments.bundled.distill import Distill
from environments.conformance import run_checks
from environments.testing import EnvironmentConformance
from inference.client import PolicyClient
from trainer.config import AdvantageConfig
from trainer.step import training_sequences

pytestmark = pytest.mark.integration


class TestDistillConformance(EnvironmentConformance):
    environment_class = Distill

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_results(cls, policy_server, policy_tokenizer):
        config = {"env": "arithmetic", "env_config": {"max_tokens": 8}, "teacher_url": policy_server.base_url}
        results = asyncio.run(
            run_checks(
                Distill,
                config,
                server_url=policy_server.base_url,
                tokenizer=policy_tokenizer,
                api_key=getattr(policy_server, "api_key", None),
            )
        )
        return {result.name: result for result in results}


async def test_the_teacher_scores_exactly_the_sampled_tokens(policy_server, tiny_model_dir):
    # The teacher is the student's own server: its score of each sampled token is the sampler's
    # logprob, so the distillation advantage is ~0 on every trained token and 0 elsewhere.
    config = {
        "env": "arithmetic",
        "env_config": {"max_tokens": 8, "group_size": 3},
        "teacher_url": policy_server.base_url,
    }
    async with PolicyClient(policy_server.base_url) as client:
        env = Distill(config, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        item = await env.get_item()
        group = await env.sample_group(item)
    assert group.objective == "distill" and group.env == "distill" and len(group.sequences) == 3
    for sequence in group.sequences:
        trained = [i for i, m in enumerate(sequence.mask) if m]
        assert all(sequence.teacher_logprobs[i] == 0.0 for i, m in enumerate(sequence.mask) if not m)
        for i in trained:
            assert sequence.teacher_logprobs[i] == pytest.approx(sequence.logprobs[i], abs=2e-2), i
    advantages = [a for s in training_sequences([group], AdvantageConfig()) for a in s.advantages]
    assert max(abs(a) for a in advantages) < 2e-2


async def test_a_teacher_that_is_not_there_stops_the_run_as_an_unreachable_policy_server_does(
    policy_server, tiny_model_dir
):
    # Not a bad rollout but a broken run: raised (a rollout task retries it, then the flow stops).
    from inference.client import PolicyServerUnreachable

    config = {"env": "arithmetic", "env_config": {"max_tokens": 4}, "teacher_url": "http://127.0.0.1:9"}
    async with PolicyClient(policy_server.base_url) as client:
        env = Distill(config, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        env.teacher.max_retries = 0
        with pytest.raises(PolicyServerUnreachable, match="127.0.0.1:9 unreachable"):
            await env.sample_group(await env.get_item())

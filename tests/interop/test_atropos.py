"""Atropos environments through `clotho env serve` from .venv-env-atropos: one in managed_server
style yields the ids and logprobs vLLM sampled and is marked token-exact, one that re-tokenizes
text (tokenize_for_trainer) is marked non-exact and counted in the flow's stats; both run through
the rollout flow into shards and the conformance suite by URL. This process never imports atroposlib."""

from __future__ import annotations

import asyncio
import json

import pytest

from core.scored_group import ScoredGroup
from environments.atropos_format import from_atropos, from_json_safe, is_exact_json, to_json_safe
from environments.conformance import run_checks, trained_segments
from environments.loading import EnvironmentLoadError, load_config, load_environment_class
from inference.client import PolicyClient
from tests.interop.conftest import rollout_groups, serve_adapter

ADAPTER = "environments.adapters.atropos:Atropos"
MANAGED = "environments.adapters.examples.atropos_managed:AdditionManagedEnv"
RETOKENIZED = "environments.adapters.examples.atropos_retokenized:AdditionRetokenizedEnv"
CONFIG = {"group_size": 3, "env_config": {"max_token_length": 8}}


@pytest.fixture(scope="module")
def served_atropos():
    served = serve_adapter("atropos", ADAPTER)
    yield served
    served.stop()


def test_atropos_items_keep_their_types_through_json() -> None:
    prompt = tuple(
        frozenset(m.items())
        for m in ({"role": "system", "content": "s"}, {"role": "user", "content": "What is 1 + 2?"})
    )
    items = [
        (prompt, 3),  # the shape many Atropos environments hand out
        {"question": "q", "answer": [1, 2.5, None, True]},
        {1: b"\x00\xff", "nested": {"__tuple__": "a dict that looks like a tag"}, "set": {3, 1, 2}},
    ]
    for item in items:
        encoded = to_json_safe(item)
        assert json.loads(json.dumps(encoded)) == encoded and is_exact_json(encoded)
        assert from_json_safe(encoded) == item and type(from_json_safe(encoded)) is type(item)
    assert to_json_safe({"b": frozenset({"y", "x"})}) == {"b": {"__frozenset__": ["x", "y"]}}  # a stable order
    opaque = to_json_safe({"when": object()})
    assert not is_exact_json(opaque)
    with pytest.raises(ValueError, match="stored as its description only"):
        from_json_safe(opaque)


def test_from_atropos_reads_tuple_messages_ref_logprobs_and_finish_reasons() -> None:
    data = {
        "tokens": [[5, 6, 7]],
        "masks": [[-100, 6, 7]],
        "scores": [0.5],
        "inference_logprobs": [[1.0, -0.1, -0.2]],
        "ref_logprobs": [[1.0, -0.3, -0.4]],
        "advantages": [],
        "messages": [({"role": "user", "content": "hi"},)],
        "overrides": [{"seat": 1}],
        "group_overrides": {"group_size": 1},
    }
    group = from_atropos(data, env="test", item_id="i", finish_reasons=["length"])
    [sequence] = group.sequences
    assert sequence.mask == [False, True, True] and sequence.logprobs == [0.0, -0.1, -0.2]
    assert sequence.ref_logprobs == [0.0, -0.3, -0.4] and sequence.advantages is None
    assert sequence.messages == [{"role": "user", "content": "hi"}] and sequence.finish_reason == "length"
    assert sequence.extras == {"seat": 1} and group.extras == {"group_size": 1}
    with pytest.raises(ValueError, match="advantages has 2 entries for 1 sequences"):
        from_atropos({**data, "advantages": [[0.0] * 3, [0.0] * 3]}, env="test", item_id="i")


def check_messages(group: ScoredGroup) -> None:
    """The environment's conversations are kept, the score Atropos gave in the last message."""
    for sequence in group.sequences:
        assert [m["role"] for m in sequence.messages] == ["system", "user", "assistant"]
        assert sequence.messages[-1]["reward"] == sequence.score


@pytest.mark.integration
def test_managed_server_groups_are_the_ids_and_logprobs_vllm_sampled(
    served_atropos, prefect_server, policy_server, policy_tokenizer, tiny_tokenizer, tmp_path
) -> None:
    config = {**CONFIG, "env": MANAGED}
    summary, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_atropos.url,
        config,
        f"file://{tmp_path}/store/managed",
        groups=2,
        concurrency=1,
    )
    [row] = summary["environments"]
    assert summary["totals"]["groups"] == 2 and len(groups) == 2 and row["non_token_exact_groups"] == 0

    async def served_logprobs(tokens: list[int]) -> list[float]:
        async with PolicyClient(policy_server.base_url, api_key=getattr(policy_server, "api_key", None)) as client:
            return await client.prompt_logprobs(tokens)

    for group in groups:
        assert group.env == "atropos" and group.extras["token_exact"] is True and group.extras["atropos_env"] == MANAGED
        prompt, answer = from_json_safe(group.extras["item"]["atropos"])  # the tuple the environment handed out
        a, b = dict(prompt[1])["content"].removeprefix("What is ").removesuffix("?").split(" + ")
        assert isinstance(prompt, tuple) and isinstance(prompt[0], frozenset) and int(a) + int(b) == answer
        assert len(group.sequences) == 3
        check_messages(group)
        for sequence in group.sequences:
            assert sequence.extras == {"token_exact": True, "logprobs_from": "environment"}
            assert sequence.policy_versions == (group.policy_version, group.policy_version)  # from what vLLM said
            [(start, end)] = trained_segments(sequence)
            assert (
                tiny_tokenizer.decode(sequence.tokens[start:end], skip_special_tokens=True)
                == sequence.messages[-1]["content"]
            )
            served = asyncio.run(served_logprobs(sequence.tokens))  # the server's logprobs of exactly these ids
            trained = [i for i, m in enumerate(sequence.mask) if m]
            assert max(abs(sequence.logprobs[i] - served[i]) for i in trained) < 1e-4
            assert all(sequence.logprobs[i] == 0.0 for i, m in enumerate(sequence.mask) if not m)


@pytest.mark.integration
def test_retokenized_groups_are_marked_non_exact_and_counted_in_the_stats(
    served_atropos, prefect_server, policy_server, policy_tokenizer, tiny_tokenizer, tmp_path
) -> None:
    config = {**CONFIG, "env": RETOKENIZED}
    summary, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_atropos.url,
        config,
        f"file://{tmp_path}/store/retokenized",
        groups=2,
        concurrency=1,
    )
    [row] = summary["environments"]
    assert summary["totals"]["groups"] == 2 and len(groups) == 2 and row["non_token_exact_groups"] == 2
    for group in groups:
        assert group.extras["token_exact"] is False and group.extras["item"]["atropos"]["answer"] > 0
        check_messages(group)
        for sequence in group.sequences:
            # the logprobs nobody sampled are the server's of the stored ids; the trained run ends with
            # the template's turn end, which tokenize_for_trainer adds and no sampler produced
            assert sequence.extras == {"token_exact": False, "logprobs_from": "rescored"}
            [(start, end)] = trained_segments(sequence)
            assert tiny_tokenizer.decode(sequence.tokens[start:end]).endswith("<|im_end|>\n")
            assert all(lp < 0.0 for lp, m in zip(sequence.logprobs, sequence.mask) if m)


@pytest.mark.integration
@pytest.mark.parametrize("env, failing", [(MANAGED, []), (RETOKENIZED, ["tokens match messages"])])
def test_the_served_adapter_passes_the_conformance_suite(
    env, failing, served_atropos, policy_server, policy_tokenizer
) -> None:
    """The managed environment passes every check; the re-tokenized one fails the suite's own
    token check (its assistant text is not its trained tokens decoded) and nothing else."""
    results = asyncio.run(
        run_checks(
            load_environment_class(served_atropos.url),
            {**CONFIG, "env": env},
            server_url=policy_server.base_url,
            tokenizer=policy_tokenizer,
            api_key=getattr(policy_server, "api_key", None),
        )
    )
    assert [r.name for r in results if r.status == "failed"] == failing
    assert [(r.name, r.detail) for r in results if r.status == "skipped"] == [
        ("gold answer scores top", "skipped: no gold_completion")
    ]


@pytest.mark.integration
def test_a_group_without_messages_gets_them_decoded_from_its_tokens(
    served_atropos, policy_server, policy_tokenizer
) -> None:
    env_class = load_environment_class(served_atropos.url)
    config = {**CONFIG, "env": MANAGED, "env_config": {"max_token_length": 8, "include_messages": False}}

    async def one_group() -> ScoredGroup:
        async with PolicyClient(policy_server.base_url, api_key=getattr(policy_server, "api_key", None)) as client:
            env = env_class(load_config(env_class, config), client=client, tokenizer=policy_tokenizer)
            await env.setup()
            group = await env.sample_group(await env.get_item())
            await env.aclose()
            return group

    group = asyncio.run(one_group())
    assert group.extras["token_exact"] is True
    for sequence in group.sequences:
        assert sequence.extras == {"token_exact": True, "logprobs_from": "environment", "messages_from": "tokens"}
        context, reply = sequence.messages  # the prompt as the model saw it, then its reply
        assert (
            context["role"] == "user" and "You add numbers." in context["content"] and "What is " in context["content"]
        )
        assert reply["role"] == "assistant" and reply["reward"] == sequence.score


@pytest.mark.integration
def test_the_service_names_a_bad_environment_or_config_field(served_atropos) -> None:
    env_class = load_environment_class(served_atropos.url)
    for config, message in [
        (
            {"env": "environments.adapters.examples.atropos_managed:Nope"},
            "environments.adapters.examples.atropos_managed has no 'Nope'",
        ),
        ({"env": "no_such_module:Env"}, "cannot import no_such_module"),
        ({"env": "environments.adapters.atropos:AtroposItem"}, "is not a subclass of atroposlib.envs.base.BaseEnv"),
        (
            {"env": MANAGED, "env_config": {"max_token_lenght": 8}},
            r"\['max_token_lenght'\] are not fields of BaseEnvConfig",
        ),
    ]:
        with pytest.raises(EnvironmentLoadError, match=message):
            load_config(env_class, config)

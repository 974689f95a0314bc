"""verifiers v1 through `clotho env serve` from .venv-env-verifiers: a taskset written in verifiers'
style, played by verifiers' own null harness on the subprocess runtime (offline: no uv, no push),
its model calls through the adapter's /inference/v1/generate route, into shards with exactly the
ids and logprobs vLLM sampled and the taskset's rewards; the conformance suite by URL."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from environments.chat import ChatRenderer
from environments.conformance import run_checks, trained_segments
from environments.loading import EnvironmentLoadError, load_config, load_environment_class
from inference.client import PolicyClient
from tests.interop.conftest import adapter_venv, rollout_groups, serve_adapter

ADAPTER = "environments.adapters.verifiers:Verifiers"
TASKSET = "environments.adapters.examples.verifiers_arithmetic"
CONFIG = {"env": {"taskset": {"id": TASKSET, "num_tasks": 8}}, "group_size": 2, "max_tokens": 12}
# The example's @vf.reward functions and their weights.
WEIGHTS = {"correct_answer": 1.0, "answer_only": 0.1}


@pytest.fixture(scope="module")
def served_verifiers():
    served = serve_adapter("verifiers", ADAPTER)
    yield served
    served.stop()


@pytest.mark.integration
def test_a_taskset_runs_through_the_rollout_flow_keeping_the_sampled_ids_logprobs_and_its_rewards(
    served_verifiers, prefect_server, policy_server, policy_tokenizer, tiny_tokenizer, tmp_path
) -> None:
    summary, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_verifiers.url,
        CONFIG,
        f"file://{tmp_path}/store/verifiers",
        groups=3,
    )
    assert summary["totals"]["groups"] == 3 and len(groups) == 3
    renderer = ChatRenderer(tiny_tokenizer)
    sequences = [sequence for group in groups for sequence in group.sequences]
    for group in groups:
        assert group.env == "verifiers" and len(group.sequences) == 2 and "rollout_errors" not in group.extras
        task = group.extras["item"]["extras"]["task"]
        assert group.item_id == task["id"] and task["prompt"].startswith("What is ")
        for sequence in group.sequences:
            [(start, end)] = trained_segments(sequence)  # one turn: the null harness stops at a reply
            assert end == len(sequence.tokens) and sequence.extras["turns"] == 1
            # The prompt verifiers rendered is the chat template's, system prompt first.
            prompt = [{"role": "system", "content": task["system_prompt"]}, {"role": "user", "content": task["prompt"]}]
            assert sequence.tokens[:start] == renderer.prompt_ids(prompt)
            assert sequence.messages[:2] == prompt and sequence.messages[2]["role"] == "assistant"
            reply = tiny_tokenizer.decode(sequence.tokens[start:end], skip_special_tokens=True)
            message = dict(sequence.messages[2])
            native = message.pop("verifiers_message", None)
            assert message == {"role": "assistant", "content": reply}  # what trained, decoded
            if native is not None:  # kept only where verifiers read it otherwise: a special token's text inside
                text = native.get("content") or ""
                # Every special added token (<|im_start|> is one; all_special_tokens names only
                # the eos/pad kind): decode(skip_special_tokens=True) drops them all.
                for special in (t.content for t in tiny_tokenizer.added_tokens_decoder.values() if t.special):
                    text = text.replace(special, "")
                assert native["role"] == "assistant" and text == reply and text != native.get("content"), native
            if sequence.finish_reason == "stop":
                assert sequence.tokens[-1] == tiny_tokenizer.eos_token_id
            else:
                assert sequence.finish_reason == "length" and end - start == CONFIG["max_tokens"]
            rewards = sequence.extras["rewards"]
            assert {name: reward["weight"] for name, reward in rewards.items()} == WEIGHTS
            assert sequence.score == pytest.approx(sum(r["score"] * r["weight"] for r in rewards.values()))
            assert set(sequence.extras["metrics"]) == {"reply_characters"}
            assert sequence.extras["stop_condition"] == "agent_completed"
            # The versions vLLM said sampled it, which verifiers' answer has no field for: kept by
            # the adapter's generate route, the group stamped from them.
            assert sequence.policy_versions == (group.policy_version, group.policy_version)
            # ... and the sampling it was drawn with (the taskset's temperature, the server's processed logprobs).
            assert sequence.sampling is not None and sequence.sampling.logprobs_mode == "processed_logprobs"

    async def served_logprobs() -> list[list[float]]:
        async with PolicyClient(policy_server.base_url, api_key=getattr(policy_server, "api_key", None)) as client:
            return await asyncio.gather(*(client.prompt_logprobs(sequence.tokens) for sequence in sequences))

    # The trained logprobs are the sampler's: the served model scores the stored ids the same.
    for sequence, scored in zip(sequences, asyncio.run(served_logprobs())):
        for trained, stored, served in zip(sequence.mask, sequence.logprobs, scored):
            assert stored == (pytest.approx(served, abs=1e-4) if trained else 0.0)


@pytest.mark.integration
def test_the_served_adapter_passes_the_conformance_suite(served_verifiers, policy_server, policy_tokenizer) -> None:
    results = asyncio.run(
        run_checks(
            load_environment_class(served_verifiers.url),
            CONFIG,
            server_url=policy_server.base_url,
            tokenizer=policy_tokenizer,
            api_key=getattr(policy_server, "api_key", None),
        )
    )
    assert [(r.name, r.status, r.detail) for r in results if r.status != "passed"] == []


@pytest.mark.integration
def test_the_service_resolves_the_verifiers_config_and_names_what_is_wrong(served_verifiers) -> None:
    env_class = load_environment_class(served_verifiers.url)
    env = load_config(env_class, CONFIG).model_dump()["env"]
    assert env == CONFIG["env"]  # kept as given; verifiers resolves it again in the session
    for config, message in [
        ({"env": {"taskset": {"id": "no-such-taskset"}}}, "taskset 'no-such-taskset' not found"),
        ({"env": {"taskset": {"id": TASKSET, "num_taskz": 3}}}, r"taskset.num_taskz\s+Extra inputs are not permitted"),
        ({"env": {}}, "env.taskset.id is required"),
        ({**CONFIG, "renderer": {"name": "no-such-renderer"}}, "Input tag 'no-such-renderer'"),
    ]:
        with pytest.raises(EnvironmentLoadError, match=message):
            load_config(env_class, config)


CONVERSATION = """
import json, sys
from types import SimpleNamespace
from verifiers.v1.dialects.chat import parse_message
from environments.adapters.verifiers import Verifiers
replies = {(): "", (1,): "4", (2, 1): "<think>two and two</think>4"}
tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: replies[tuple(ids)])
recorded = [  # what verifiers recorded for each sampled turn
    parse_message({"role": "assistant", "content": ""}),  # an empty reply: content None to verifiers
    parse_message({"role": "assistant", "content": "4"}),
    parse_message({"role": "assistant", "content": "4", "reasoning_content": "two and two"}),
]
nodes = [SimpleNamespace(sampled=True, token_ids=list(ids) + [0], mask=[True] * len(ids) + [False], message=message)
         for ids, message in zip(replies, recorded)]
json.dump(Verifiers.conversation(SimpleNamespace(tokenizer=tokenizer), SimpleNamespace(nodes=nodes)), sys.stdout)
"""


@pytest.mark.integration
def test_a_sampled_turn_keeps_verifiers_own_message_only_where_it_reads_otherwise() -> None:
    venv = adapter_venv("verifiers")
    done = subprocess.run([venv / "bin" / "python", "-c", CONVERSATION], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    empty, plain, reasoned = json.loads(done.stdout)
    assert empty == {"role": "assistant", "content": ""}  # the same reading: nothing kept beside it
    assert plain == {"role": "assistant", "content": "4"}
    assert reasoned == {
        "role": "assistant",
        "content": "<think>two and two</think>4",
        "verifiers_message": {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
    }


BRANCH_COMPLETIONS = """
import json, sys
from types import SimpleNamespace
from core.sampling import Sampling
from environments.adapters.verifiers import Verifiers
from environments.adapters.verifiers_generate import GenerateServer
from inference.client import Completion, recording_completions

route = GenerateServer("http://127.0.0.1:9", None, 0, 0.0)  # nothing is sent: the lookup alone
hot = Sampling(temperature=1.25, logprobs_mode="processed_logprobs")
def answered(ids, logprobs, versions):
    route.completions[(tuple(ids), tuple(logprobs))] = Completion(ids, logprobs, "stop", versions=versions, sampling=hot)
answered([7, 8], [-0.5, -1.5], [3, 4])  # a turn the route answered across a reload
answered([9], [-0.25], [4])
answered([5], [-2.0], None)  # answered by a server that gives no versions
adapter = SimpleNamespace(generate=route)
node = lambda prompt, sampled, logprobs: SimpleNamespace(  # noqa: E731
    token_ids=prompt + sampled, mask=[False] * len(prompt) + [True] * len(sampled), logprobs=logprobs
)
two_turns = SimpleNamespace(nodes=[node([1, 2], [7, 8], [-0.5, -1.5]), node([3], [], []), node([4], [9], [-0.25])])
unanswered = SimpleNamespace(nodes=[node([1], [7, 8], [-0.5, -1.25])])  # the logprobs differ: not that completion
no_versions = SimpleNamespace(nodes=[node([1], [5], [-2.0])])
with recording_completions() as recorded:
    found = [Verifiers.branch_completions(adapter, branch) for branch in (two_turns, unanswered, no_versions)]
describe = lambda c: None if c is None else [c.policy_versions, c.sampling.temperature]
json.dump({"found": [[describe(c) for c in turns] for turns in found], "recorded": [describe(c) for c in recorded]}, sys.stdout)
"""


@pytest.mark.integration
def test_each_sequence_has_the_versions_and_sampling_of_the_completions_its_turns_are() -> None:
    venv = adapter_venv("verifiers")
    done = subprocess.run(
        [venv / "bin" / "python", "-c", BRANCH_COMPLETIONS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # Each turn the completion the route answered it with (its versions and temperature), None where it did not.
    assert result["found"] == [[[[3, 4], 1.25], [[4, 4], 1.25]], [None], [[None, 1.25]]]
    assert result["recorded"] == [[[3, 4], 1.25], [[4, 4], 1.25], None, [None, 1.25]]  # the group's record too


@pytest.mark.integration
def test_an_episode_of_two_trainable_agents_stores_both_traces_as_sequences_of_the_group(
    served_verifiers, prefect_server, policy_server, policy_tokenizer, tmp_path
) -> None:
    """Self-play in verifiers' terms (examples/verifiers_two_seats: two trainable agents per
    episode, as upstream kuhn_poker): every trainable trace is a sequence with its own mask,
    logprobs and score; a group is group_size episodes x 2 samples."""
    config = {
        "env": {"taskset": {"id": "environments.adapters.examples.verifiers_two_seats"}},
        "group_size": 2,
        "max_tokens": 6,
    }
    summary, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_verifiers.url,
        config,
        f"file://{tmp_path}/store/two-seats",
        groups=2,
    )
    assert summary["totals"]["groups"] == 2 and summary["totals"]["failures"] == 0, summary
    for group in groups:
        assert len(group.sequences) == 4, [s.extras for s in group.sequences]
        seats = sorted((s.extras["episode"], s.extras["agent"]) for s in group.sequences)
        assert seats == [(0, "player0"), (0, "player1"), (1, "player0"), (1, "player1")]
        for sequence in group.sequences:
            assert any(sequence.mask) and all(lp < 0 for lp, m in zip(sequence.logprobs, sequence.mask) if m)
            assert sequence.score == sequence.extras["rewards"]["correct"]["score"]
    # Capped where the config says: one sample an episode is too few for two agents.
    one = {**config, "samples_per_episode": 1}
    summary, _ = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_verifiers.url,
        one,
        f"file://{tmp_path}/store/one-seat",
        groups=1,
    )
    assert summary["totals"]["groups"] == 0 and summary["totals"]["failures"] == 1, (
        summary
    )  # each episode failed, saying why


UPSTREAM = Path(__file__).resolve().parents[1] / "data" / "upstream" / "verifiers" / "environments"


@pytest.fixture(scope="module")
def served_upstream():
    """The adapter with upstream kuhn_poker and code_golf installed as verifiers installs an
    environment (each its own package: taskset ids kuhn-poker and code-golf), in one layer over
    .venv-env-verifiers (clotho env serve --requirements DIR --requirements DIR)."""
    served = serve_adapter(
        "verifiers",
        ADAPTER,
        ("--requirements", str(UPSTREAM / "kuhn_poker"), "--requirements", str(UPSTREAM / "code_golf")),
    )
    yield served
    served.stop()


@pytest.mark.integration
def test_upstream_kuhn_poker_self_play_stores_each_seat_s_trace_with_its_payoff(
    served_upstream, prefect_server, policy_server, policy_tokenizer, tmp_path
) -> None:
    config = {"env": {"taskset": {"id": "kuhn-poker"}}, "group_size": 2, "max_tokens": 8}
    summary, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_upstream.url,
        config,
        f"file://{tmp_path}/store/kuhn",
        groups=2,
    )
    assert summary["totals"]["groups"] == 2 and summary["totals"]["failures"] == 0, summary
    for group in groups:
        assert (
            2 <= len(group.sequences) <= 4
        )  # a seat that never got to move (the other forfeited first) trains nothing
        by_episode: dict[int, dict[str, float]] = {}
        for sequence in group.sequences:
            assert any(sequence.mask) and sequence.extras["agent"] in ("player0", "player1")
            by_episode.setdefault(sequence.extras["episode"], {})[sequence.extras["agent"]] = sequence.score
        for seats in by_episode.values():  # zero-sum: the payoff the Env recorded on each seat's trace
            assert all(score in (-2.0, -1.0, 1.0, 2.0) for score in seats.values()) and (
                len(seats) < 2 or sum(seats.values()) == 0
            )


@pytest.mark.integration
def test_upstream_code_golf_stores_every_attempt_with_the_sibling_comparison_s_rewards(
    served_upstream, prefect_server, policy_server, policy_tokenizer, tmp_path
) -> None:
    """code_golf fans an episode into `attempts` (2) attempts of one golfer, runs each program in
    the attempt's subprocess runtime and scores the attempts against each other in finalize():
    each attempt is a sequence of the group with the rewards verifiers recorded on its trace."""
    config = {"env": {"taskset": {"id": "code-golf"}}, "group_size": 2, "max_tokens": 24}
    summary, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_upstream.url,
        config,
        f"file://{tmp_path}/store/golf",
        groups=2,
    )
    assert summary["totals"]["groups"] == 2 and summary["totals"]["failures"] == 0, summary
    for group in groups:
        assert len(group.sequences) == 4  # 2 episodes x 2 attempts
        for sequence in group.sequences:
            rewards = sequence.extras["rewards"]
            assert any(sequence.mask) and {"correct", "most_concise", "fastest"} <= set(rewards), rewards
            # The stand-in's program never prints the answer: no attempt passes, and a failed one
            # earns nothing on either comparison (finalize's rule).
            assert sequence.score == 0.0 and rewards["most_concise"]["score"] == rewards["fastest"]["score"] == 0.0

"""Which policy versions sampled a group: per-token tags from the server, ranges per sequence and
turn, the group's stamp, and a server that reports none."""

from __future__ import annotations

import httpx
import pytest

from core.scored_group import ScoredGroup, ScoredSequence
from environments.trajectory import Trajectory, stamp_versions
from inference.client import Completion, PolicyClient, PolicyServerAuthError, loaded_version, parse_weight_version, recording_versions, token_versions, version_tag


def completion(tokens: list[int], versions: list[int] | None) -> Completion:
    return Completion(token_ids=tokens, logprobs=[-0.5] * len(tokens), finish_reason="stop", versions=versions)


def test_a_tag_names_the_loaded_weights_and_the_announced_version():
    assert version_tag(7) == version_tag(7, 7) == "7"
    tag = version_tag(7, 6)
    assert (loaded_version(tag), parse_weight_version(tag)) == (7, 6)  # sampling with 7, the run told 6
    assert (loaded_version("default"), parse_weight_version("default")) == (0, 0)
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": tag, "start": 2, "end": 5}]
    assert token_versions(spans, 5) == [3, 3, 7, 7, 7] and token_versions(None, 5) is None


def test_turns_sampled_by_different_versions_make_one_sequence_with_the_range():
    trajectory = Trajectory()
    trajectory.add_context([1, 2])
    trajectory.add_sampled(completion([3, 4], [5, 6]))  # a swap during the first turn
    trajectory.add_context([9])
    trajectory.add_sampled(completion([5], [7]))
    sequence = trajectory.to_sequence(1.0)
    assert sequence.policy_versions == (5, 7) and trajectory.turns == 2
    assert ScoredSequence.from_completion([1], completion([2, 3], [4, 4]), 0.0).policy_versions == (4, 4)
    assert ScoredSequence.from_completion([1], completion([2], None), 0.0).policy_versions is None


def group_of(*sequences: ScoredSequence) -> ScoredGroup:
    return ScoredGroup(env="e", item_id="i", sequences=list(sequences))


def test_the_group_is_stamped_with_its_oldest_version_and_raw_sequences_get_the_whole_range():
    tracked = ScoredSequence.from_completion([1], completion([2], [6]), 1.0)
    raw = ScoredSequence.from_prompt([1], [3], [-0.5], score=0.0)  # built from token lists
    group = group_of(tracked, raw)
    assert stamp_versions(group, [(6, 6), (4, 5)], announced=9) == 4
    assert tracked.policy_versions == (6, 6) and raw.policy_versions == (4, 6)
    # A completion from a server that reports no versions: the stamp is at most the announced one.
    group = group_of(ScoredSequence.from_completion([1], completion([2], [6]), 1.0))
    assert stamp_versions(group, [(6, 6), None], announced=5) == 5
    # Nothing sampled (a demonstration): the announced version, nothing invented.
    demo = group_of(ScoredSequence.from_prompt([1], [2], [0.0], score=1.0))
    assert stamp_versions(demo, [], announced=3) == 3 and demo.sequences[0].policy_versions is None


async def test_a_server_without_the_generate_route_is_sampled_through_completions_once_asked():
    """Another OpenAI-compatible server (or vLLM without --enable-scale-out): asked once, then
    /v1/completions, whose answers carry no versions."""
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/inference/v1/generate":
            return httpx.Response(403, json={"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out"}})
        choice = {"token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "length", "text": "ab"}
        return httpx.Response(200, json={"choices": [choice]})

    client = PolicyClient("http://policy")
    client._http = httpx.AsyncClient(base_url="http://policy", transport=httpx.MockTransport(answer))
    async with client:
        with recording_versions() as sampled:
            [first] = await client.complete([1, 2], max_tokens=2)
            [second] = await client.complete([1, 2], max_tokens=2)
    assert seen == ["/inference/v1/generate", "/v1/completions", "/v1/completions"]
    assert first.token_ids == second.token_ids == [7, 8] and first.versions is None and sampled == [None, None]


async def test_a_refused_key_on_the_generate_route_is_still_an_auth_error():
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, json={"error": "Forbidden"})

    client = PolicyClient("http://policy", api_key="wrong")
    client._http = httpx.AsyncClient(base_url="http://policy", transport=httpx.MockTransport(answer))
    async with client:
        with pytest.raises(PolicyServerAuthError, match="refused the API key given"):
            await client.complete([1, 2], max_tokens=2)


def test_an_atropos_sequence_covered_by_sampled_completions_gets_their_versions():
    from environments.atropos_format import IGNORE_INDEX, check_sequence

    first, second = completion([4, 5], [3, 3]), completion([7], [4])  # two turns, a reload between
    tokens, masks = [1, 2, 4, 5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 4, 5, IGNORE_INDEX, 7]
    sampled = {(1, 2): [first], (1, 2, 4, 5, 6): [second]}
    check = check_sequence(tokens, masks, None, sampled)
    assert check.exact and check.policy_versions == (3, 4)
    # Text the environment re-tokenized is covered by nothing sampled: no versions of its own.
    assert check_sequence([1, 2, 9, 9], [IGNORE_INDEX, IGNORE_INDEX, 9, 9], None, sampled).policy_versions is None

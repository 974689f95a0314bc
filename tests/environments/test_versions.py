"""Which policy versions and sampling parameters drew a group: per-token tags from the server,
ranges per sequence and turn, the group's stamp, a server that reports none, and the parameters
each completion was requested with."""

from __future__ import annotations

import httpx
import pytest

from core.sampling import Sampling
from core.scored_group import InvalidGroupError, ScoredGroup, ScoredSequence
from environments.trajectory import Trajectory, complete_record, version_stamp
from inference.client import (
    Completion,
    PolicyClient,
    PolicyServerAuthError,
    PolicyServerError,
    loaded_version,
    parse_weight_version,
    recording_completions,
    token_versions,
    version_tag,
)

HOT = Sampling(temperature=1.25, logprobs_mode="processed_logprobs")
COLD = Sampling(temperature=0.7, logprobs_mode="processed_logprobs")


def completion(tokens: list[int], versions: list[int] | None, sampling: Sampling | None = HOT) -> Completion:
    return Completion(
        token_ids=tokens, logprobs=[-0.5] * len(tokens), finish_reason="stop", versions=versions, sampling=sampling
    )


def stamp(group: ScoredGroup, sampled: list[Completion | None], announced: int) -> int:
    complete_record(group, sampled)
    return version_stamp(group, sampled, announced)


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
    assert stamp(group, [completion([2], [6]), completion([3], [4, 5])], announced=9) == 4
    assert tracked.policy_versions == (6, 6) and raw.policy_versions == (4, 6)
    # A completion from a server that reports no versions: the stamp is at most the announced one.
    group = group_of(ScoredSequence.from_completion([1], completion([2], [6]), 1.0))
    assert stamp(group, [completion([2], [6]), completion([3], None)], announced=5) == 5
    # One this process never saw (an adapter's route did not answer it): the same.
    group = group_of(ScoredSequence.from_completion([1], completion([2], [6]), 1.0))
    assert stamp(group, [completion([2], [6]), None], announced=5) == 5
    # Nothing sampled (a demonstration): the announced version, nothing invented.
    demo = group_of(ScoredSequence.from_prompt([1], [2], [0.0], score=1.0))
    assert stamp(demo, [], announced=3) == 3 and demo.sequences[0].policy_versions is None
    assert demo.sequences[0].sampling is None


def test_a_sequence_carries_the_sampling_of_its_completions():
    assert ScoredSequence.from_completion([1], completion([2], [4]), 0.0).sampling == HOT
    trajectory = Trajectory()
    trajectory.add_context([1])
    trajectory.add_sampled(completion([2], [4]))
    trajectory.add_context([3])
    trajectory.add_sampled(completion([4], [4]))
    assert trajectory.to_sequence(1.0).sampling == HOT
    with pytest.raises(ValueError, match="turn 3 sampled with .*temperature=0.7.*sample every turn of a sequence"):
        trajectory.add_sampled(completion([5], [4], COLD))


def test_a_sequence_built_from_token_lists_gets_the_sampling_its_group_was_drawn_with():
    raw = ScoredSequence.from_prompt([1], [3], [-0.5], score=0.0)
    tracked = ScoredSequence.from_completion([1], completion([2], [6], COLD), 1.0)
    group = group_of(tracked, raw)
    complete_record(group, [completion([2], [6], HOT), None])
    assert raw.sampling == HOT and tracked.sampling == COLD  # its own kept
    # Drawn with two parameter sets: which one drew the raw sequence is unknown, so the group is invalid.
    raw = ScoredSequence.from_prompt([1], [3], [-0.5], score=0.0)
    with pytest.raises(InvalidGroupError, match=r"sequences\[0\].sampling: unset.*2 different parameter sets"):
        complete_record(group_of(raw), [completion([2], [6], HOT), completion([3], [6], COLD)])


async def test_a_server_without_the_generate_route_is_sampled_through_completions_once_asked():
    """Another OpenAI-compatible server (or vLLM without --enable-scale-out): asked once, then
    /v1/completions, whose answers carry no versions."""
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/server_info":
            return httpx.Response(404)
        if request.url.path == "/inference/v1/generate":
            return httpx.Response(
                403,
                json={
                    "error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out"}
                },
            )
        choice = {
            "token_ids": [7, 8],
            "logprobs": {"token_logprobs": [-0.1, -0.2]},
            "finish_reason": "length",
            "text": "ab",
        }
        return httpx.Response(200, json={"choices": [choice]})

    client = PolicyClient("http://policy")
    client._http = httpx.AsyncClient(base_url="http://policy", transport=httpx.MockTransport(answer))
    async with client:
        with recording_completions() as sampled:
            [first] = await client.complete([1, 2], max_tokens=2, temperature=0.7)
            [second] = await client.complete([1, 2], max_tokens=2, temperature=0.7)
    # /server_info is read once, beside the first request (not before it: no round-trip added).
    assert seen.count("/server_info") == 1
    assert [path for path in seen if path != "/server_info"] == [
        "/inference/v1/generate",
        "/v1/completions",
        "/v1/completions",
    ]
    assert first.token_ids == second.token_ids == [7, 8] and first.versions is None
    assert sampled == [first, second] and [c.policy_versions for c in sampled] == [None, None]
    # What was sent, and a logprobs mode the server did not say (no /server_info: no dev mode).
    assert first.sampling == Sampling(temperature=0.7, logprobs_mode=None)


async def test_the_sampling_sent_and_the_server_s_logprobs_mode_travel_with_each_completion():
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}})
        sent.append(request)
        return httpx.Response(404)

    client = PolicyClient("http://policy")
    client._http = httpx.AsyncClient(base_url="http://policy", transport=httpx.MockTransport(answer))
    client.generate_route = True  # straight to the generate route; the 404 ends the test
    async with client:
        assert await client.logprobs_mode() == "processed_logprobs"
        with pytest.raises(PolicyServerError, match="404"):
            await client.complete([1, 2], max_tokens=2, temperature=1.25, top_k=5, min_p=0.1)
    body = sent[0].read().decode()
    assert '"top_k":5' in body and '"min_p":0.1' in body and '"temperature":1.25' in body


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

"""The ScoredGroup contract: validation errors name the sequence, field and fix; Atropos round trip."""

import math

import pytest

from core.scored_group import SCHEMA_VERSION, InvalidGroupError, ScoredGroup, ScoredSequence
from environments.atropos_format import from_atropos, to_atropos


def seq(**overrides):
    fields = dict(tokens=[1, 2, 3, 4], mask=[False, False, True, True], logprobs=[0.0, 0.0, -0.5, -1.5], score=1.0)
    fields.update(overrides)
    return ScoredSequence(**fields)


def group(*sequences, **fields):
    return ScoredGroup(env="test", item_id="i1", sequences=list(sequences), **fields)


def test_a_valid_group_carries_its_contract_fields():
    g = group(seq(), seq(score=0.0), policy_version=3, extras={"curriculum": {"level": 2}})
    assert g.schema_version == SCHEMA_VERSION and g.policy_version == 3
    assert g.scores == [1.0, 0.0] and g.num_tokens == 8
    assert len({group(seq()).group_id for _ in range(50)}) == 50


def test_from_prompt_masks_the_prompt():
    s = ScoredSequence.from_prompt([7, 8], [9, 10, 11], [-0.1, -0.2, -0.3], score=0.5)
    assert s.tokens == [7, 8, 9, 10, 11] and s.mask == [False, False, True, True, True]
    assert s.logprobs == [0.0, 0.0, -0.1, -0.2, -0.3]


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(mask=[True, True]), r"sequences\[1\]\.mask: length 2 != len\(tokens\) 4; give one mask entry per token"),
        (dict(logprobs=[0.0]), r"sequences\[1\]\.logprobs: length 1 != len\(tokens\) 4"),
        (dict(advantages=[1.0]), r"sequences\[1\]\.advantages: length 1 != len\(tokens\) 4"),
        (dict(mask=[False] * 4), r"sequences\[1\]\.mask: no trained token"),
        (dict(score=math.nan), r"sequences\[1\]\.score: nan is not finite"),
        (dict(score=math.inf), r"sequences\[1\]\.score: inf is not finite"),
        (dict(advantages=[0.0, 0.0, math.nan, 1.0]), r"sequences\[1\]\.advantages: contains NaN or inf"),
        (dict(logprobs=[0.0, 0.0, -math.inf, 0.0]), r"sequences\[1\]\.logprobs: contains NaN or inf"),
        (dict(tokens=[1, 2, -3, 4]), r"sequences\[1\]\.tokens: negative token id"),
        (dict(finish_reason="eos"), r"sequences\[1\]\.finish_reason: 'eos'; use one of"),
    ],
)
def test_each_contract_break_is_named(bad, message):
    with pytest.raises(InvalidGroupError, match=message):
        group(seq(), seq(**bad))


def test_empty_group_is_refused():
    with pytest.raises(InvalidGroupError, match="sequences is empty; a group needs at least one sequence"):
        group()


def test_limits_need_the_run_context():
    g = group(seq(), seq(tokens=[1, 2, 3, 600]))
    with pytest.raises(InvalidGroupError, match=r"sequences\[1\]\.tokens: id 600 >= vocab size 512"):
        g.check_limits(vocab_size=512)
    with pytest.raises(InvalidGroupError, match=r"2 sequences > 1 expected \(group_size 1\)"):
        g.check_limits(max_group_size=1)
    g.check_limits(vocab_size=601, max_group_size=2)


def test_atropos_round_trip():
    g = group(
        seq(messages=[{"role": "user", "content": "hi"}], advantages=[0.0, 0.0, 1.0, -1.0]),
        seq(score=0.0, messages=[{"role": "user", "content": "yo"}], advantages=[0.0] * 4),
        extras={"k": 1},
    )
    data = to_atropos(g)
    assert data["masks"][0] == [-100, -100, 3, 4]
    assert data["inference_logprobs"][0] == [1.0, 1.0, -0.5, -1.5]
    back = from_atropos(data, env="test", item_id="i1")
    for a, b in zip(g.sequences, back.sequences):
        assert (a.tokens, a.mask, a.logprobs, a.score, a.advantages, a.messages) == (
            b.tokens,
            b.mask,
            b.logprobs,
            b.score,
            b.advantages,
            b.messages,
        )
    assert back.extras == {"k": 1}

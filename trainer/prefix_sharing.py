"""Prefix sharing: the sequences of one group that begin with the same untrained tokens (GRPO's n
samples of one prompt) are laid out as that prefix once, followed by each sequence's own rest.

Each rest attends to the prefix and to itself (causal), its position ids continue from the
prefix's length, and its first token is predicted by the prefix's last slot (PackedBatch.
predictors), so every trained token's logprob and gradient are those of the sequence laid out
alone: a causal model's prefix states do not depend on what follows them, and the gradients the
rests send back through the shared prefix add up as the copies' would. What it saves is the
prefix's forward and backward for all but one sequence of the group: on the demo task (8 prompts
of ~27 tokens, 16 answers of ~4 tokens each) a step computes ~730 slots instead of ~3,970
(bench/bench_trainer.py measures the update).

Sharing is chosen per group by the packer's cost model (slots x (token_work + row length), a dense
mask over the row): it pays where answers are short next to the prompt, not where a row of 16 long
answers would make its attention cost more than the prompt's copies did; long groups may share in
chunks, each chunk with a copy of the prefix. Dpo pairs and groups whose sequences were sampled
at different temperatures are laid out as before (the prefix's last slot predicts each rest's
first token, at one temperature).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainer.packing import TrainingSequence, row_cost


def shared_prefix_length(sequences: Sequence[TrainingSequence]) -> int:
    """The longest prefix every sequence has token for token, with no trained token in it, and
    leaving every sequence at least one token of its own."""
    if len(sequences) < 2:
        return 0
    limit = min(len(s.tokens) for s in sequences) - 1
    for s in sequences:
        trained = next((index for index, flag in enumerate(s.mask) if flag), len(s.tokens))
        limit = min(limit, trained)
    first = sequences[0].tokens
    length = 0
    while length < limit and all(s.tokens[length] == first[length] for s in sequences[1:]):
        length += 1
    return length


def chunk_count(lengths: Sequence[int], prefix: int, token_budget: int, token_work: int) -> int:
    """How many units a group of sequences of `lengths` sharing `prefix` tokens is best laid out
    in: 0 when not sharing costs least (each sequence alone, sdpa's causal kernel: half the
    keys), else the number of chunks, each the prefix and a run of the sequences' rests."""
    alone = sum(row_cost(n, token_work, causal_kernel=True) for n in lengths)
    best, best_cost = 0, alone
    count = 1
    while count <= len(lengths):
        bounds = [len(lengths) * k // count for k in range(count + 1)]
        units = [prefix + sum(n - prefix for n in lengths[a:b]) for a, b in zip(bounds, bounds[1:])]
        if max(units) <= token_budget:
            cost = sum(row_cost(u, token_work) for u in units)
            if cost < best_cost:
                best, best_cost = count, cost
        count *= 2
    return best


def share_prefixes(sequences: Sequence[TrainingSequence], token_budget: int, token_work: int) -> list[TrainingSequence]:
    """The sequences with each group's shared prefix laid out once where that costs less: a prefix
    sequence (untrained) followed by the rests that continue it, one unit each chunk, in place of
    the group's sequences. Other sequences come back unchanged, in order."""
    groups: dict[int, list[int]] = {}
    for index, sequence in enumerate(sequences):
        if sequence.group >= 0 and sequence.unit >= 0:
            groups.setdefault(sequence.group, []).append(index)
    layouts: dict[int, list[TrainingSequence]] = {}
    next_unit = max((s.unit for s in sequences), default=-1) + 1
    for members in groups.values():
        group = [sequences[i] for i in members]
        prefix = shared_prefix_length(group)
        if prefix < 2 or any(s.unit == group[0].unit for s in group[1:]):  # too short, or a pair's unit
            continue
        if any(s.temperature != group[0].temperature for s in group[1:]):  # the prefix's last slot predicts at one
            continue
        count = chunk_count([len(s.tokens) for s in group], prefix, token_budget, token_work)
        if count == 0:
            continue
        laid_out: list[TrainingSequence] = []
        bounds = [len(group) * k // count for k in range(count + 1)]
        for start, end in zip(bounds, bounds[1:]):
            head = group[start]
            laid_out.append(
                replace(
                    head,
                    tokens=head.tokens[:prefix],
                    mask=[False] * prefix,
                    old_logprobs=[0.0] * prefix,
                    advantages=[0.0] * prefix,
                    ref_logprobs=None if head.ref_logprobs is None else [0.0] * prefix,
                    name=f"{head.name} and {end - start - 1} more: their shared prefix",
                    unit=next_unit,
                    prefix=True,
                )
            )
            for s in group[start:end]:
                laid_out.append(
                    replace(
                        s,
                        tokens=s.tokens[prefix:],
                        mask=s.mask[prefix:],
                        old_logprobs=s.old_logprobs[prefix:],
                        advantages=s.advantages[prefix:],
                        ref_logprobs=None if s.ref_logprobs is None else s.ref_logprobs[prefix:],
                        unit=next_unit,
                        position_offset=prefix,
                    )
                )
            next_unit += 1
        layouts[members[0]] = laid_out
        for index in members[1:]:
            layouts[index] = []
    result: list[TrainingSequence] = []
    for index, sequence in enumerate(sequences):
        result.extend(layouts.get(index, [sequence]))
    return result

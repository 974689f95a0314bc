"""Packing: training sequences -> micro-batches of rows (whole sequences, a bounded row length)
under a token budget, with their attention masks. trainer.step builds a step's sequences from
scored groups and packs them here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean attention mask as an additive one: 0 where allowed, the dtype's min elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


@dataclass(frozen=True)
class TrainingSequence:
    """One sequence ready to pack: equal-length per-token lists and what to call it in errors."""

    tokens: list[int]
    mask: list[bool]
    old_logprobs: list[float]
    advantages: list[float]
    name: str
    objective: str = "rl"
    ref_logprobs: list[float] | None = None  # stored by the environment (dpo); else the trainer's
    unit: int = -1  # sequences of one unit (a dpo pair) are packed side by side; -1: on its own
    group: int = -1  # the step's group it came from: a group's sequences may share their prompt
    # trainer.prefix_sharing: a shared prefix (untrained) is its unit's first sequence; the others
    # continue it, attending to it, their positions starting at its length (position_offset).
    prefix: bool = False
    position_offset: int = 0
    # The temperature its sampler's logprobs are at (core.scored_group.Sampling.logprob_temperature):
    # the trainer scores it under logits / temperature, the distribution that drew it.
    temperature: float = 1.0


@dataclass
class PackedBatch:
    """One micro-batch: rows of equal length, each holding whole sequences end to end and padded at
    its end (trainer.packing.pack_micro_batches).

    input_ids, position_ids, sequence_ids, mask, old_logprobs, advantages: [rows, row length].
    position_ids restart at 0 for every sequence; the sequences are kept apart by their boundaries
    (`sequence_bounds`, for variable-length attention) or, where sequences continue shared
    prefixes, by `attention_mask`, block-diagonal per row (trainer.attention). sequence_ids is
    0..n-1 by sequence over the rows in order and -1 on padding. mask is True on trained tokens
    only: never on padding and never on the first token of a sequence, which has no prediction
    (see losses.token_logprobs).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    sequence_lengths: list[int]
    sequence_objectives: list[str] = field(default_factory=list)
    # Reference logprobs the environment stored, [rows, L], and where there are any, [rows, L] bool;
    # None when no sequence of the micro-batch has them.
    stored_ref_logprobs: torch.Tensor | None = None
    has_stored_ref: torch.Tensor | None = None
    # With shared prefixes (trainer.prefix_sharing): the id of the prefix each sequence continues
    # (None: it stands alone), and [rows, L] the slot whose logits predict each slot's token (the
    # one before it, but the prefix's last slot for the first token of a sequence continuing one).
    sequence_prefixes: list[int | None] = field(default_factory=list)
    predictors: torch.Tensor | None = None
    # [rows, L] the temperature of each slot's sequence (1.0 on padding), which divides the logits
    # the slot gives; None when every sequence's is 1.
    temperatures: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.input_ids.numel()

    @property
    def num_padding(self) -> int:
        return self.num_slots - sum(self.sequence_lengths)

    @property
    def num_trained_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def num_sequences(self) -> int:
        """Sequences with at least one trained token: the ones a sequence-mean loss counts."""
        return int(torch.unique(self.sequence_ids[self.mask]).numel())

    @property
    def objectives(self) -> list[str]:
        """The objectives of this micro-batch's sequences, each once, in first-seen order."""
        return list(dict.fromkeys(self.sequence_objectives))

    def objective_mask(self, objective: str) -> torch.Tensor:
        """[1, T] bool: the trained tokens of the sequences trained with `objective`."""
        chosen = torch.tensor(
            [index for index, name in enumerate(self.sequence_objectives) if name == objective],
            dtype=torch.long,
        )
        return self.mask & torch.isin(self.sequence_ids, chosen)

    def objective_counts(self, objective: str) -> tuple[int, int]:
        """(sequences with a trained token, trained tokens) of `objective` in this micro-batch."""
        mask = self.objective_mask(objective)
        return int(torch.unique(self.sequence_ids[mask]).numel()), int(mask.sum())

    def needs_reference(self, kl: bool) -> bool:
        """Whether the trainer's reference model must score this micro-batch: its dpo tokens (and,
        with a KL penalty, every trained token) that have no stored reference logprobs."""
        needed = self.mask if kl else self.objective_mask("dpo")
        if self.has_stored_ref is not None:
            needed = needed & ~self.has_stored_ref
        return bool(needed.any())

    def needs_mask(self) -> bool:
        """Whether attention needs `attention_mask`, the dense one: a sequence continues a shared
        prefix. Else each sequence attends causally within itself, which needs no mask
        (trainer.attention)."""
        return self.predictors is not None

    def shares_rows(self) -> bool:
        """Whether some row holds more than one sequence (or one not from its first slot): plain
        causal attention over the rows would then cross sequences, and sequence_bounds keeps them
        apart. False: one sequence a row from slot 0, whose padding at the row's end it never sees."""
        rows = self.input_ids.shape[0]
        return len(self.sequence_lengths) != rows or not torch.equal(self.sequence_ids[:, 0], torch.arange(rows))

    def sequence_bounds(self) -> tuple[torch.Tensor, int]:
        """The sequences' boundaries over the rows flattened end to end, int32 [n + 1] from 0 to
        rows x L (each row's padding a segment of its own), and the longest segment: what
        variable-length attention (trainer.attention) takes instead of a mask."""
        ids = self.sequence_ids
        rows, length = ids.shape
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        bounds = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([rows * length])]).to(torch.int32)
        return bounds, int((bounds[1:] - bounds[:-1]).max())

    def attention_mask(self) -> torch.Tensor:
        """Block-diagonal causal mask [rows, 1, L, L] bool, True where a query may attend to a key.

        A sequence that continues a shared prefix attends to all of the prefix's columns and
        causally to its own. A padding slot attends only to itself, so no softmax row is empty (an
        empty row gives NaN in sdpa). Use `additive_mask` for models that want 0 / -inf instead of
        booleans.
        """
        rows, length = self.input_ids.shape
        mask = torch.eye(length, dtype=torch.bool).repeat(rows, 1, 1)
        starts = [
            tuple((self.sequence_ids == index).nonzero()[0].tolist()) for index in range(len(self.sequence_lengths))
        ]
        prefixes = self.sequence_prefixes or [None] * len(self.sequence_lengths)
        for index, size in enumerate(self.sequence_lengths):
            row, start = starts[index]  # the sequence's first slot
            mask[row, start : start + size, start : start + size] = torch.ones(size, size, dtype=torch.bool).tril()
            prefix = prefixes[index]
            if prefix is not None:  # all of the prefix's columns
                prefix_start, shared = starts[prefix][1], self.sequence_lengths[prefix]
                mask[row, start : start + size, prefix_start : prefix_start + shared] = True
        return mask[:, None]


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: indices into `lengths`, grouped so each group's total fits the budget
    (used for the rows of a micro-batch: the budget is the row length).

    Longest first, each into the first bin with room; within a bin the indices are in input order.
    Deterministic for a given input. Every length must be <= token_budget.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > token_budget:
            raise ValueError(f"length {lengths[i]} at index {i} > token budget {token_budget}")
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(token_budget - lengths[i])
    return [sorted(b) for b in bins]


def pack_micro_batches(
    sequences: Sequence[TrainingSequence],
    token_budget: int,
    row_multiple: int = 8,
    token_work: int = 0,
    padded_rows: bool = True,
) -> list[PackedBatch]:
    """Pack whole sequences into micro-batches of rows, each micro-batch at most `token_budget`
    slots (rows x row length). Shorter sequences share rows (first fit decreasing), each attending
    only within itself; rows fill micro-batches in order.

    The row length: a multiple of `row_multiple` at least the longest unit's (a dpo pair side by
    side; any other sequence alone), the one that costs least (choose_row_length: the least
    padding, since each sequence attends within itself in any row). With `padded_rows`, when no
    sequence must share its row (no dpo pair), the plain padded batch competes too.
    """
    for sequence in sequences:
        if len(sequence.tokens) > token_budget:
            raise ValueError(
                f"{sequence.name}: {len(sequence.tokens)} tokens > micro_batch_tokens "
                f"{token_budget}; raise trainer micro_batch_tokens to at least "
                f"{len(sequence.tokens)} or lower the environment's maximum tokens"
            )
    # Units (a dpo pair; any other sequence on its own) are planned whole, their sequences in order.
    units: dict[int, list[int]] = {}
    for index, sequence in enumerate(sequences):
        units.setdefault(sequence.unit if sequence.unit >= 0 else -1 - index, []).append(index)
    members = list(units.values())
    lengths = [sum(len(sequences[i].tokens) for i in unit) for unit in members]
    for unit, length in zip(members, lengths, strict=True):
        if length > token_budget:
            raise ValueError(
                f"{sequences[unit[0]].name} and the rest of its dpo pair: {length} tokens > micro_batch_tokens "
                f"{token_budget}; a pair trains in one micro-batch: raise micro_batch_tokens to at least {length}"
            )
    if not members:
        return []
    padded = padded_rows and all(len(unit) == 1 for unit in members)
    # Rows that need the dense mask (a shared prompt) pay for it.
    dense = any(s.prefix or s.position_offset for s in sequences)
    row_length, plan = choose_row_length(lengths, token_budget, row_multiple, token_work, padded, dense)
    rows = [sorted(i for u in units_in_row for i in members[u]) for units_in_row in plan]
    # As few micro-batches as the budget allows, the rows shared evenly (124 + 4 rows would pay a
    # whole forward and backward for the last four).
    count = math.ceil(len(rows) / (token_budget // row_length))
    bounds = [len(rows) * k // count for k in range(count + 1)]
    return [_pack(sequences, rows[start:end], row_length) for start, end in zip(bounds, bounds[1:])]


# What keeping a row's sequences apart by their bounds costs beyond their slots, as a share of a
# slot's work: on CPU each layer gathers the sequences' queries, keys and values into padded buckets
# and puts the outputs back (trainer.attention.bucketed). Measured at the demo's shape (128 answers of
# 31 and 33 tokens, forward and backward, 2 cores): in 64 rows of 64 kept apart by their bounds
# 0.111 s (tiny model) and 0.537 s (small), one a row 0.099 and 0.496 s, with 3% more slots. CUDA's flash
# variable-length kernel reads the rows in place; the same margin there only favours the plain
# padded batch where lengths are alike, where the two cost about the same.
SHARED_ROW_OVERHEAD = 0.2


def row_cost(length: int, token_work: int, causal_kernel: bool = False) -> float:
    """The modelled cost of a row of `length` slots under a dense mask (each slot token_work plus
    every key of the row) or, with `causal_kernel`, of one sequence alone (half the keys)."""
    return length * (token_work + (length / 2 if causal_kernel else length))


def choose_row_length(
    lengths: Sequence[int],
    token_budget: int,
    row_multiple: int,
    token_work: int,
    padded: bool = False,
    dense: bool = False,
) -> tuple[int, list[list[int]]]:
    """(row length, rows of indices into `lengths`) of least modelled cost.

    Per token, a transformer layer does ~24 d^2 multiply-adds outside attention and ~4 d n inside
    it, n the keys it attends, so a slot costs ~6 d (token_work) plus a key per key it attends.
    Rows that several sequences share keep them apart by their bounds (trainer.attention): each
    sequence attends causally within itself whatever row it is in, so rows differ only by their
    slots, padding included (plus SHARED_ROW_OVERHEAD a slot), and the least padding wins. With `dense` (a shared prompt or a hook
    needs the dense mask) every slot attends its whole row: longer rows waste less padding,
    shorter ones less attention. Candidates, each a multiple of
    `row_multiple` within the budget: from the longest length up to twice it in (at most 32) even
    steps (one of 31 and one of 33 fill a row of 64 where rows of 40 would pad each by a fifth),
    then steps of 1.25x; of equal slots, the shortest rows (a bounded set of row lengths keeps
    kernel autotuning and compile caches warm).

    With `padded`, the plain padded batch is a candidate too: one sequence a row at the longest
    length exactly, which runs sdpa's causal kernel, in one call, its padding attending itself:
    each slot attends half the row. It wins where lengths are alike (answers of one length).
    """

    def rounded(length: float) -> int:
        return min(math.ceil(length / row_multiple) * row_multiple, token_budget)

    longest = rounded(max(lengths))
    step = max(math.ceil(longest / 32 / row_multiple), 1) * row_multiple
    candidates = set(range(longest, min(2 * longest, token_budget) + 1, step))
    target = 2.0 * longest
    while target < token_budget:
        candidates.add(rounded(target))
        target *= 1.25
    candidates.add(rounded(min(target, token_budget)))
    attention = sum(length * length / 2 for length in lengths)  # each sequence within itself, in any row
    best: tuple[float, int, list[list[int]]] | None = None
    for row_length in sorted(candidates):
        rows = plan_micro_batches(lengths, row_length)
        cost = (
            len(rows) * row_cost(row_length, token_work)
            if dense
            else len(rows) * row_length * (token_work + 1) * (1 + SHARED_ROW_OVERHEAD) + attention
        )
        if best is None or cost < best[0]:
            best = (cost, row_length, rows)
    assert best is not None
    if padded:
        longest = max(lengths)
        if len(lengths) * longest * (token_work + 1 + longest / 2) < best[0]:
            return longest, [[index] for index in range(len(lengths))]
    return best[1], best[2]


def _pack(all_sequences: Sequence[TrainingSequence], rows: Sequence[list[int]], row_length: int) -> PackedBatch:
    """Rows of whole sequences (indices into `all_sequences`, each row in input order), each padded
    at its end to `row_length`. Sequence ids 0..n-1 follow the input order, so a dpo pair's two
    (one row's neighbours) have consecutive ids, the chosen first."""
    order = sorted(i for row in rows for i in row)
    ids = {index: position for position, index in enumerate(order)}
    sequences = [all_sequences[i] for i in order]
    fill = {
        "input_ids": 0,
        "positions": 0,
        "ids": -1,
        "mask": False,
        "old": 0.0,
        "advantages": 0.0,
        "ref": 0.0,
        "has_ref": False,
        "predictors": 0,
        "temperatures": 1.0,
    }
    columns: dict[str, list[list]] = {name: [] for name in fill}
    prefix_of: dict[int, int | None] = {}
    for row in rows:
        padding = row_length - sum(len(all_sequences[i].tokens) for i in row)
        values: dict[str, list] = {name: [] for name in fill}
        prefix: tuple[int, int] | None = None  # (id, last slot) of the row's newest shared prefix
        for index in row:
            s = all_sequences[index]
            slot = len(values["input_ids"])
            shared = prefix if s.position_offset > 0 else None  # (id, last slot) this sequence continues
            values["predictors"] += [shared[1] if shared else max(slot - 1, 0)] + list(
                range(slot, slot + len(s.tokens) - 1)
            )
            prefix_of[ids[index]] = shared[0] if shared else None
            if s.prefix:
                prefix = (ids[index], slot + len(s.tokens) - 1)
            values["input_ids"] += s.tokens
            values["positions"] += range(s.position_offset, s.position_offset + len(s.tokens))
            values["ids"] += [ids[index]] * len(s.tokens)
            values["mask"] += s.mask
            values["old"] += s.old_logprobs
            values["advantages"] += s.advantages
            values["ref"] += s.ref_logprobs if s.ref_logprobs is not None else [0.0] * len(s.tokens)
            values["has_ref"] += [s.ref_logprobs is not None] * len(s.tokens)
            values["temperatures"] += [s.temperature] * len(s.tokens)
        for name, value in values.items():
            columns[name].append(value + [fill[name]] * padding)
    any_stored = any(s.ref_logprobs is not None for s in sequences)
    shares = any(p is not None for p in prefix_of.values())
    return PackedBatch(
        input_ids=torch.tensor(columns["input_ids"], dtype=torch.long),
        position_ids=torch.tensor(columns["positions"], dtype=torch.long),
        sequence_ids=torch.tensor(columns["ids"], dtype=torch.long),
        mask=torch.tensor(columns["mask"], dtype=torch.bool),
        old_logprobs=torch.tensor(columns["old"], dtype=torch.float32),
        advantages=torch.tensor(columns["advantages"], dtype=torch.float32),
        sequence_lengths=[len(s.tokens) for s in sequences],
        sequence_objectives=[s.objective for s in sequences],
        stored_ref_logprobs=torch.tensor(columns["ref"], dtype=torch.float32) if any_stored else None,
        has_stored_ref=torch.tensor(columns["has_ref"], dtype=torch.bool) if any_stored else None,
        sequence_prefixes=[prefix_of[i] for i in range(len(sequences))] if shares else [],
        predictors=torch.tensor(columns["predictors"], dtype=torch.long) if shares else None,
        temperatures=torch.tensor(columns["temperatures"], dtype=torch.float32)
        if any(s.temperature != 1.0 for s in sequences)
        else None,
    )


def padding_waste(batches: Sequence[PackedBatch]) -> float:
    """Padded slots / all slots over the micro-batches; 0.0 when there are none."""
    slots = sum(b.num_slots for b in batches)
    return sum(b.num_padding for b in batches) / slots if slots else 0.0

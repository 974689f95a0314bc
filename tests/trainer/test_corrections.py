"""Each off-policy correction equals its paper's formula in value and gradient: written here again
token by token, in plain Python over each sequence, with pi_old = sg(pi) (one optimizer step per
batch) and mu the sampler."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import LossConfig
from trainer.losses import policy_loss

# Three sequences; importance weights rho = pi / mu chosen on both sides of every default bound
# (icepop [0.5, 5], mis 2, cispo 5, dppo's cap 5), advantages of both signs, one sequence of one token.
RHOS = [[1.0, 0.3, 7.0, 1.5], [2.5, 0.9], [0.45]]
ADVANTAGES = [[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5], [2.0]]
PROBS = [[0.5, 0.2, 0.9, 0.6], [0.3, 0.25], [0.05]]  # pi of each token; mu = pi / rho


def leaf_logprobs() -> list[list[torch.Tensor]]:
    return [[torch.tensor(math.log(p), dtype=torch.float64, requires_grad=True) for p in seq] for seq in PROBS]


def sampler(i: int, t: int) -> float:
    return math.log(PROBS[i][t] / RHOS[i][t])


def packed(leaves: list[list[torch.Tensor]], advantages_by_token: list[list[float]]):
    """The sequences as one row each, padded: [3, 4] tensors with a trained-token mask."""
    rows = len(leaves)
    logprobs = torch.stack(
        [torch.stack(seq + [torch.tensor(0.0, dtype=torch.float64)] * (4 - len(seq))) for seq in leaves]
    )
    mu = torch.zeros(rows, 4, dtype=torch.float64)
    advantages = torch.zeros(rows, 4, dtype=torch.float64)
    mask = torch.zeros(rows, 4, dtype=torch.bool)
    for i, seq in enumerate(leaves):
        for t in range(len(seq)):
            mu[i, t], advantages[i, t], mask[i, t] = sampler(i, t), advantages_by_token[i][t], True
    return logprobs, mu, advantages, mask


def clotho(
    name: str, advantages_by_token=ADVANTAGES, config: dict | None = None, **options
) -> tuple[float, list[list[float]], dict]:
    leaves = leaf_logprobs()
    logprobs, mu, advantages, mask = packed(leaves, advantages_by_token)
    loss, metrics = policy_loss(
        logprobs, mu, advantages, mask, LossConfig(name=name, options=options, **(config or {}))
    )
    loss.backward()
    return loss.item(), [[leaf.grad.item() for leaf in seq] for seq in leaves], metrics


def reference(objective) -> tuple[float, list[list[float]]]:
    """-J and its gradient, J = objective(leaves) written from the paper."""
    leaves = leaf_logprobs()
    loss = -objective(leaves)
    loss.backward()
    return loss.item(), [[leaf.grad.item() for leaf in seq] for seq in leaves]


def assert_same(ours, theirs):
    assert ours[0] == pytest.approx(theirs[0], rel=1e-9, abs=1e-12)
    for mine, paper in zip(ours[1], theirs[1], strict=True):
        assert mine == pytest.approx(paper, rel=1e-9, abs=1e-12)


def rho(leaf: torch.Tensor, i: int, t: int) -> float:
    return math.exp(leaf.item() - sampler(i, t))


def r(leaf: torch.Tensor) -> torch.Tensor:  # pi / pi_old with pi_old = sg(pi)
    return torch.exp(leaf - leaf.detach())


@pytest.mark.parametrize("name, low, high", [("icepop", 0.5, 5.0), ("mis_token", 0.0, 2.0)])
def test_token_masks_equal_their_formula(name, low, high):
    # IcePop: J = 1/G sum_i 1/|y_i| sum_t M(k) min(r A, clip(r, 0.8, 1.2) A), M(k) = k on [alpha, beta], else 0.
    def objective(leaves):
        total = 0.0
        for i, seq in enumerate(leaves):
            terms = []
            for t, leaf in enumerate(seq):
                k = rho(leaf, i, t)
                m = k if low <= k <= high else 0.0
                a = ADVANTAGES[i][t]
                terms.append(m * torch.minimum(r(leaf) * a, r(leaf).clamp(0.8, 1.2) * a))
            total = total + sum(terms) / len(seq)
        return total / len(leaves)

    ours = clotho(name)
    assert_same(ours, reference(objective))
    outside = sum(not low <= k <= high for seq in RHOS for k in seq)
    assert ours[2]["masked_tokens"] == outside == (3 if name == "icepop" else 2)
    # The gradient is M(k) A / (G |y|) per token, by hand for the first sequence.
    assert ours[1][0] == pytest.approx([-(k if low <= k <= high else 0) * 1.0 / (3 * 4) for k in RHOS[0]])


def test_sequence_mask_equals_its_formula():
    # rho_i = prod_t rho_i,t; J = 1/G sum_i 1/|y_i| sum_t rho_i 1[rho_i <= 2] A r.
    def objective(leaves):
        total = 0.0
        for i, seq in enumerate(leaves):
            weight = math.prod(rho(leaf, i, t) for t, leaf in enumerate(seq))
            weight = weight if weight <= 2.0 else 0.0
            total = total + sum(weight * ADVANTAGES[i][t] * r(leaf) for t, leaf in enumerate(seq)) / len(seq)
        return total / len(leaves)

    ours = clotho("mis_sequence")
    assert_same(ours, reference(objective))
    # products: 1 x 0.3 x 7 x 1.5 = 3.15 (rejected), 2.5 x 0.9 = 2.25 (rejected), 0.45 (kept)
    assert ours[2]["masked_sequences"] == 2 and ours[2]["masked_tokens"] == 6
    assert_same(
        clotho("mis_sequence", low=0.5, high=4.0),
        reference(
            lambda leaves: (
                sum(
                    sum(
                        (w if 0.5 <= (w := math.prod(rho(leaf, i, t) for t, leaf in enumerate(seq))) <= 4.0 else 0.0)
                        * ADVANTAGES[i][t]
                        * r(leaf)
                        for t, leaf in enumerate(seq)
                    )
                    / len(seq)
                    for i, seq in enumerate(leaves)
                )
                / len(leaves)
            )
        ),
    )


def test_cispo_equals_its_formula():
    # J = 1 / sum|o| * sum_i sum_t sg(clip(rho, 0, 5)) A log pi.
    def objective(leaves):
        total = sum(
            min(rho(leaf, i, t), 5.0) * ADVANTAGES[i][t] * leaf
            for i, seq in enumerate(leaves)
            for t, leaf in enumerate(seq)
        )
        return total / sum(len(seq) for seq in leaves)

    ours = clotho("cispo")
    assert_same(ours, reference(objective))
    assert ours[2]["capped_tokens"] == 1  # rho 7


def test_dppo_equals_its_formula():
    # J = 1 / sum|o| * sum M sg(min(rho, 5)) A log pi; M = 0 where A > 0 and pi - mu > 0.2, or A < 0 and pi - mu < -0.2.
    def objective(leaves):
        total = 0.0
        for i, seq in enumerate(leaves):
            for t, leaf in enumerate(seq):
                pi, mu, a = math.exp(leaf.item()), math.exp(sampler(i, t)), ADVANTAGES[i][t]
                masked = (a > 0 and pi - mu > 0.2) or (a < 0 and pi - mu < -0.2)
                total = total + (0.0 if masked else min(rho(leaf, i, t), 5.0)) * a * leaf
        return total / sum(len(seq) for seq in leaves)

    ours = clotho("dppo")
    assert_same(ours, reference(objective))
    # pi - mu: 0.9 - 0.9/7 = 0.77 (A > 0: masked); 0.6 - 0.4 = 0.2 (not more than delta); 0.3 - 0.12 > 0 with A < 0: kept
    assert ours[2]["masked_tokens"] == 1 and ours[2]["capped_tokens"] == 0
    assert_same(
        clotho("dppo", delta_high=0.1, cap=2.0),
        reference(
            lambda leaves: (
                sum(
                    (
                        0.0
                        if (pi := math.exp(leaf.item())) - math.exp(sampler(i, t)) > 0.1
                        and ADVANTAGES[i][t] > 0
                        or pi - math.exp(sampler(i, t)) < -0.2
                        and ADVANTAGES[i][t] < 0
                        else min(rho(leaf, i, t), 2.0)
                    )
                    * ADVANTAGES[i][t]
                    * leaf
                    for i, seq in enumerate(leaves)
                    for t, leaf in enumerate(seq)
                )
                / 7
            )
        ),
    )


def test_gspo_equals_its_paper_with_the_sampler_as_old_policy():
    # GSPO (arXiv 2507.18071; pi_old := mu as its section 5.4 allows): s_i = (pi(y_i) / mu(y_i))^(1/|y_i|),
    # J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i), sequence-level advantages. clotho's
    # gspo also truncates the weight at importance_cap (TIS, where A < 0 and s_i > 2); without it, the paper.
    advantages = [1.0, -0.5, 2.0]

    def objective(leaves):
        total = 0.0
        for i, seq in enumerate(leaves):
            s = torch.exp(sum(leaf - sampler(i, t) for t, leaf in enumerate(seq)) / len(seq))
            total = total + torch.minimum(s * advantages[i], s.clamp(1 - 3e-4, 1 + 4e-4) * advantages[i])
        return total / len(leaves)

    by_token = [[a] * len(seq) for a, seq in zip(advantages, PROBS, strict=True)]
    # s_i: 3.15^(1/4) = 1.33 (A > 0: clipped), 1.5 (A < 0: unclipped), 0.45 (A > 0: unclipped)
    assert_same(clotho("gspo", by_token, config={"importance_cap": None}), reference(objective))


def test_unknown_options_are_refused_with_the_ones_a_correction_takes():
    with pytest.raises(
        ValueError, match=r"loss.options: \['alpha'\] not settings of loss icepop; it takes low \(default 0.5\), high"
    ):
        LossConfig(name="icepop", options={"alpha": 0.4})
    assert LossConfig(name="icepop", options={"low": 0.2}).options == {"low": 0.2, "high": 5.0}

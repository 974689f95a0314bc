"""Realistic ScoredGroups for storage tests: random token ids, float32 logprobs, every field set."""

from __future__ import annotations

import random

import numpy as np

from core.sampling import Sampling
from core.scored_group import ScoredGroup, ScoredSequence


def make_group(
    rng: random.Random,
    *,
    env: str = "gsm8k",
    policy_version: int = 0,
    size: int = 4,
    max_tokens: int = 40,
    item_id: str | None = None,
) -> ScoredGroup:
    """A group whose logprobs are float32 values, so the float32 columns store them exactly."""
    prompt = [rng.randrange(150_000) for _ in range(rng.randrange(1, max_tokens // 2))]
    sequences = []
    for index in range(size):
        completion = [rng.randrange(150_000) for _ in range(rng.randrange(1, max_tokens // 2))]
        logprobs = np.float32([-rng.expovariate(3.0) for _ in completion]).tolist()
        with_extras = index % 2 == 0
        sequences.append(
            ScoredSequence.from_prompt(
                prompt,
                completion,
                logprobs,
                score=rng.choice([0.0, 1.0, 0.5, -1.25]),
                advantages=np.float32([rng.uniform(-1, 1) for _ in range(len(prompt) + len(completion))]).tolist()
                if with_extras
                else None,
                finish_reason=rng.choice(["stop", "length"]),
                messages=[
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": f"4 ({index})"},
                ]
                if with_extras
                else None,
                extras={"reward_parts": {"format": 1.0, "answer": 0.5}, "note": "é ✓"} if with_extras else {},
                # sampled by one version, across a reload, or unknown (a server that does not say)
                policy_versions=[(policy_version, policy_version), (policy_version, policy_version + 1), None][
                    index % 3
                ],
                # drawn at a temperature, greedily, or not recorded (a demonstration)
                sampling=[
                    Sampling(temperature=1.25, logprobs_mode="processed_logprobs"),
                    Sampling(temperature=0.0),
                    None,
                ][index % 3],
            )
        )
    return ScoredGroup(
        env=env,
        item_id=item_id or f"item-{rng.randrange(10**6)}",
        sequences=sequences,
        policy_version=policy_version,
        chat_template="chatml" if rng.random() < 0.5 else None,
        extras={"difficulty": rng.randrange(5), "tags": ["a", "b"]},
    )


def make_groups(count: int, seed: int = 0, **fields) -> list[ScoredGroup]:
    rng = random.Random(seed)
    return [make_group(rng, **fields) for _ in range(count)]

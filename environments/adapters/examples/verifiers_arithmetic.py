"""A verifiers v1 taskset written in verifiers' own style (`vf init`'s layout): small sums, scored by
two `@vf.reward`s. Served to clotho by environments.adapters.verifiers:

    {"env": {"taskset": {"id": "environments.adapters.examples.verifiers_arithmetic", "num_tasks": 8}}}

It imports verifiers, so it loads only in .venv-env-verifiers.
"""

import random
import re

import verifiers.v1 as vf

_LAST_INTEGER = re.compile(r"-?\d+(?=\D*$)")


class ArithmeticData(vf.TaskData):
    """One sum; `answer` is the reference the rewards compare with."""

    answer: str


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def correct_answer(self, trace: vf.Trace) -> float:
        """1.0 when the last integer of the reply is the sum."""
        match = _LAST_INTEGER.search(trace.last_reply)
        return float(match is not None and match.group() == self.data.answer)

    @vf.reward(weight=0.1)
    async def answer_only(self, trace: vf.Trace) -> float:
        """1.0 when the reply is the number and nothing else, as the prompt asks."""
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def reply_characters(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithmeticConfig(vf.TasksetConfig):
    num_tasks: int = 16
    """How many sums to build."""
    max_operand: int = 20
    """Operands are drawn from 0..max_operand."""
    seed: int = 0
    """Seed of the operands."""


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self) -> list[ArithmeticTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for index in range(self.config.num_tasks):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            data = ArithmeticData(
                id=f"sum-{index}",
                prompt=f"What is {a} + {b}? Give only the final answer.",
                system_prompt="You are a careful calculator.",
                answer=str(a + b),
            )
            tasks.append(ArithmeticTask(data, self.config.task))
        return tasks


__all__ = ["ArithmeticTaskset"]

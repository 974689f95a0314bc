"""A verifiers v1 Env in verifiers' own style with two trainable agents: both seats answer the same
small sum, so one episode gives two training samples (two traces), as a two-player self-play Env
(upstream kuhn_poker) does. Served to clotho by environments.adapters.verifiers:

    {"env": {"taskset": {"id": "environments.adapters.examples.verifiers_two_seats"}}, "group_size": 2}

each group then holds group_size x 2 sequences, each naming its agent. It imports verifiers, so it
loads only in .venv-env-verifiers.
"""

import asyncio
import random

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 4


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        rng = random.Random(0)
        tasks = []
        for index in range(self.config.num_tasks):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            data = SumData(id=f"sum-{index}", prompt=f"What is {a} + {b}? Answer with the number.", answer=str(a + b))
            tasks.append(SumTask(data, self.config.task))
        return tasks


class TwoSeatsConfig(vf.EnvConfig):
    player0: vf.AgentConfig = vf.AgentConfig()
    player1: vf.AgentConfig = vf.AgentConfig()


class TwoSeatsEnv(vf.Env[TwoSeatsConfig]):
    """Both agents play the task at once; each trace is scored by the task's rewards."""

    async def run(self, task, agents) -> None:
        await asyncio.gather(agents.player0.run(task), agents.player1.run(task))


__all__ = ["SumTaskset", "TwoSeatsEnv"]

"""An Atropos environment in Atropos's own style that samples through managed_server, as
Atropos's gsm8k_server does: the tokens, masks and logprobs it returns are the ones the inference
server sampled, so its groups are token-exact. For the adapter's tests and as an example.

Run by clotho's adapter (in .venv-env-atropos):
    config {"env": "environments.adapters.examples.atropos_managed:AdditionManagedEnv", "group_size": 4}
or by Atropos itself: `python -m environments.adapters.examples.atropos_managed serve ...`.

Items are what many Atropos environments hand out: a tuple of the prompt (a tuple of frozensets of
message items) and the answer. Reward, gsm8k's: 1.0 when the reply holds the sum, else -1.0.
Unlike gsm8k it keeps groups whose scores are all equal (Atropos drops them when sending); it
returns the conversations when config.include_messages (Atropos's switch) is set.
"""

import random

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.type_definitions import Item

system_prompt = "You add numbers. Answer with the sum only."


class AdditionManagedEnv(BaseEnv):
    name = "addition_managed"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        env_config = BaseEnvConfig(
            tokenizer_name="Qwen/Qwen2.5-0.5B-Instruct",
            group_size=4,
            use_wandb=True,
            max_token_length=16,
            include_messages=True,
            wandb_name="addition_managed",
        )
        server_configs = [
            APIServerConfig(model_name="Qwen/Qwen2.5-0.5B-Instruct", base_url="http://localhost:9001/v1", api_key="x")
        ]
        return env_config, server_configs

    async def setup(self):
        rng = random.Random(0)
        self.train = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(100)]
        self.iter = 0

    async def get_next_item(self) -> Item:
        a, b = self.train[self.iter % len(self.train)]
        self.iter += 1
        prompt = tuple(
            frozenset(message.items())
            for message in (
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": f"What is {a} + {b}?"},
            )
        )
        return (prompt, a + b)

    def score_reply(self, reply: str, answer: int) -> float:
        return 1.0 if str(answer) in reply else -1.0

    async def collect_trajectories(self, item: Item) -> tuple[ScoredDataGroup, list[Item]]:
        messages = [dict(message) for message in item[0]]
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            chat_completions = await managed.chat_completion(
                messages=messages,
                n=self.config.group_size,
                max_tokens=self.config.max_token_length,
                temperature=1.0,
            )
            nodes = managed.get_state()["nodes"]

        scores = ScoredDataGroup()
        scores["tokens"], scores["masks"], scores["scores"] = [], [], []
        scores["inference_logprobs"] = []
        if self.config.include_messages:
            scores["messages"] = []
        for choice, node in zip(chat_completions.choices, nodes):
            reply = choice.message.content
            scores["tokens"].append(node.tokens)
            scores["masks"].append(node.masked_tokens)
            scores["inference_logprobs"].append(node.logprobs)
            scores["scores"].append(self.score_reply(reply, item[1]))
            if self.config.include_messages:
                scores["messages"].append(messages + [{"role": "assistant", "content": reply}])
        return scores, []

    async def evaluate(self, *args, **kwargs):
        correct = []
        for a, b in self.train[:8]:
            completion = await self.server.chat_completion(
                messages=[
                    {"role": "system", "content": system_prompt},
                    {"role": "user", "content": f"What is {a} + {b}?"},
                ],
                n=1,
                max_tokens=self.config.max_token_length,
                temperature=0.0,
                split="eval",
            )
            correct.append(self.score_reply(completion.choices[0].message.content, a + b) > 0)
        await self.evaluate_log(metrics={"eval/percent_correct": sum(correct) / len(correct)})


if __name__ == "__main__":
    AdditionManagedEnv.cli()

"""An Atropos environment in the other common Atropos style: chat_completion for text, then
tokenize_for_trainer to turn the conversation back into tokens. The trained tokens are the reply
re-tokenized, plus the template's turn end, not the ids the server sampled: the adapter marks its
groups {"token_exact": false} and counts them. For the adapter's tests and as an example.

Run by clotho's adapter (in .venv-env-atropos):
    config {"env": "environments.adapters.examples.atropos_retokenized:AdditionRetokenizedEnv", "group_size": 4}

Items are dataset rows ({"question", "answer"}); the reward is atropos_managed's.
"""

import random

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.type_definitions import Item
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

system_prompt = "You add numbers. Answer with the sum only."


class AdditionRetokenizedEnv(BaseEnv):
    name = "addition_retokenized"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        env_config = BaseEnvConfig(
            tokenizer_name="Qwen/Qwen2.5-0.5B-Instruct",
            group_size=4,
            use_wandb=True,
            max_token_length=16,
            wandb_name="addition_retokenized",
        )
        server_configs = [
            APIServerConfig(model_name="Qwen/Qwen2.5-0.5B-Instruct", base_url="http://localhost:9001/v1", api_key="x")
        ]
        return env_config, server_configs

    async def setup(self):
        rng = random.Random(1)
        self.train = []
        for _ in range(100):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            self.train.append({"question": f"What is {a} + {b}?", "answer": a + b})
        self.iter = 0

    async def get_next_item(self) -> Item:
        row = self.train[self.iter % len(self.train)]
        self.iter += 1
        return row

    async def collect_trajectories(self, item: Item) -> tuple[ScoredDataGroup, list[Item]]:
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": item["question"]}]
        chat_completions = await self.server.chat_completion(
            messages=messages,
            n=self.config.group_size,
            max_tokens=self.config.max_token_length,
            temperature=1.0,
        )
        scores = ScoredDataGroup()
        scores["tokens"], scores["masks"], scores["scores"], scores["messages"] = [], [], [], []
        for choice in chat_completions.choices:
            conversation = messages + [{"role": "assistant", "content": choice.message.content}]
            tokenized = tokenize_for_trainer(
                self.tokenizer, conversation, include_messages=True, finish_reason=choice.finish_reason
            )
            scores["tokens"].append(tokenized["tokens"])
            scores["masks"].append(tokenized["masks"])
            scores["messages"].append(tokenized["messages"])
            scores["scores"].append(1.0 if str(item["answer"]) in choice.message.content else -1.0)
        return scores, []

    async def evaluate(self, *args, **kwargs):
        pass  # this example has no test split


if __name__ == "__main__":
    AdditionRetokenizedEnv.cli()

"""One side of bench_remote.py, run by the Python of the environment's own venv: collects groups one
after another and prints the mean seconds per group as JSON.

    python -m bench.remote_probe ENVIRONMENT CONFIG_JSON SERVER_URL TOKENIZER GROUPS
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from environments.base import RolloutFailure
from environments.loading import load_config, load_environment_class
from inference.client import PolicyClient

WARM_UP = 2


async def main(environment: str, config: dict, server: str, tokenizer: str, groups: int) -> dict:
    env_class = load_environment_class(environment)
    async with PolicyClient(server) as client:
        env = env_class(load_config(env_class, config), client=client, tokenizer=tokenizer)
        await env.setup()
        seconds = []
        for index in range(WARM_UP + groups):
            started = time.perf_counter()  # the item's round trip counts too
            item = await env.get_item()
            result = await env.sample_group(item)
            if isinstance(result, RolloutFailure):
                raise RuntimeError(f"{environment}: {result.error}")
            if index >= WARM_UP:
                seconds.append(time.perf_counter() - started)
    return {"mean_s": sum(seconds) / len(seconds), "groups": groups}


if __name__ == "__main__":
    environment, config, server, tokenizer, groups = sys.argv[1:6]
    print(json.dumps(asyncio.run(main(environment, json.loads(config), server, tokenizer, int(groups)))))

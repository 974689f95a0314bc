"""The soak's graded groups: Distinct's groups scored by the real graders of code_exec and llm_judge.

Each member of a group is given an answer planned from its item id (`planned`), so the score it
must get is known: in the sandbox, a correct program that spends CPU_S of CPU (1), one that returns
a wrong value (0) and an endless loop (0), run by `CodeExec.verdict`, starved runs retried and
failed as `infra`; before the judge, a joke whose score the soak's judge (`JudgeServer`) derives
from its text, asked through `LLMJudge.judge`, a judge past `judge_timeout_s` retried and failed as
`infra`. The faults (`hog_in_sandbox`, `hang_judge`) load the host or stop the judge mid-segment;
after each segment `soak.checks.tally` compares every stored group's scores with the planned ones:
a machinery failure scored as a reward shows up there, whatever it was scored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

import httpx
from pydantic import Field

from core.scored_group import ScoredSequence
from environments.base import Item
from environments.bundled.code_exec import CodeExec, CodeItem
from environments.bundled.llm_judge import CONNECT_RETRIES, JudgeConfig, LLMJudge
from soak.groups import Distinct, DistinctConfig, draw_group

CPU_S = 0.4  # what a correct program spends: about 4 s of wall time at a tenth of a core
TESTS = ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"]
BUSY = f"import time\n_end = time.process_time() + {CPU_S}\nwhile time.process_time() < _end:\n    pass\n"
ANSWERS = {  # program -> the score the sandbox must give it when it gets its CPU
    BUSY + "def add(a, b):\n    return a + b": 1.0,
    "def add(a, b):\n    return a - b": 0.0,
    "def add(a, b):\n    while True:\n        pass": 0.0,
}
CORRECT, WRONG, ENDLESS = ANSWERS
TOPIC = "cats"
JUDGE_MODEL = "soak-judge"


class GradedConfig(DistinctConfig):
    grader: Literal["sandbox", "judge"] = Field(description="Who scores: code_exec's sandbox or llm_judge's judge.")
    judge_url: str | None = Field(default=None, description="The soak's judge (JudgeServer), for grader=judge.")
    judge_timeout_s: float = Field(default=1.0, gt=0, description="llm_judge's judge_timeout_s.")
    wall_seconds: float = Field(default=3.0, gt=0, description="The sandbox's wall-clock limit.")
    cpu_seconds: int = Field(default=1, ge=1, description="The sandbox's CPU limit: the endless loop's end.")


class Graded(Distinct):
    """Distinct's groups (tokens drawn from the item id), each member scored by a real grader."""

    name = "graded"
    config_class = GradedConfig

    async def setup(self) -> None:
        await super().setup()
        c = self.config
        if c.grader == "sandbox":
            self.grader = CodeExec(
                {"limits": {"wall_seconds": c.wall_seconds, "cpu_seconds": c.cpu_seconds}},
                client=None,
                tokenizer=self.tokenizer,
            )
        else:
            if not c.judge_url:
                raise ValueError("judge_url: grader=judge needs the soak judge's base URL")
            judge = JudgeConfig(judge_url=c.judge_url, judge_model=JUDGE_MODEL, judge_timeout_s=c.judge_timeout_s)
            self.grader = LLMJudge(judge, client=None, tokenizer=self.tokenizer)

    async def collect_trajectories(self, item: Item):
        drawn = draw_group(item.id, self.config.group_size, env=self.name).sequences
        answers = planned(item.id, self.config.group_size, self.config.grader)
        if self.config.grader == "sandbox":
            code = CodeItem(id=item.id, prompt="add", tests=TESTS, solution="")

            async def graded(sequence: ScoredSequence, answer: str) -> ScoredSequence:
                verdict = await asyncio.to_thread(self.grader.verdict, code, f"```python\n{answer}\n```")
                return sequence.model_copy(update={"score": verdict.score})

            rollouts = [graded(sequence, answer) for sequence, (answer, _) in zip(drawn, answers, strict=True)]
            sequences, errors = await self.gather_sequences(rollouts)
        else:
            transport = httpx.AsyncHTTPTransport(retries=CONNECT_RETRIES)
            async with httpx.AsyncClient(
                base_url=self.config.judge_url, timeout=self.config.judge_timeout_s, transport=transport
            ) as http:

                async def judged(sequence: ScoredSequence, joke: str) -> ScoredSequence:
                    messages = [
                        {"role": "user", "content": f"Write a short joke about {TOPIC}."},
                        {"role": "assistant", "content": joke},
                    ]
                    score = await self.grader.judge(
                        http, Item(id=item.id, prompt="joke", extras={"topic": TOPIC}), messages
                    )
                    return sequence.model_copy(update={"score": score})

                rollouts = [judged(sequence, joke) for sequence, (joke, _) in zip(drawn, answers, strict=True)]
                sequences, errors = await self.gather_sequences(rollouts)
        return self.finished(item, sequences, errors)


def planned(item_id: str, group_size: int, grader: str) -> list[tuple[str, float]]:
    """Per member: its answer and the score it must get. Sandbox: member 0 the correct program,
    member 1 the endless loop, the rest drawn (correct or wrong); judge: a joke per member."""
    if grader == "judge":
        jokes = [f"joke {item_id}/{member}" for member in range(group_size)]
        return [(joke, (judge_points(joke) - 1) / 9) for joke in jokes]
    rng = random.Random(f"{item_id} answers")
    programs = [CORRECT, ENDLESS, *(rng.choice([CORRECT, WRONG]) for _ in range(group_size - 2))][:group_size]
    return [(program, ANSWERS[program]) for program in programs]


def judge_points(joke: str) -> int:
    """The soak judge's 1..10 for a joke: a function of its text, as a greedy judge's is."""
    return 1 + int(hashlib.sha256(joke.encode()).hexdigest(), 16) % 10


class JudgeServer:
    """An OpenAI-compatible judge on loopback answering llm_judge's request with judge_points of the
    joke; `hang(seconds)`: requests arriving meanwhile are accepted and not answered until then."""

    def __init__(self) -> None:
        self.hang_until = 0.0
        self.requests = 0
        self.held = 0  # requests that arrived while it hung
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.answer({"object": "list", "data": [{"id": JUDGE_MODEL, "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests += 1
                if time.monotonic() < server.hang_until:
                    server.held += 1
                    time.sleep(server.hang_until - time.monotonic())
                question = body["messages"][0]["content"]
                joke = question.split("\n\n")[1]
                self.answer(
                    {
                        "object": "chat.completion",
                        "model": JUDGE_MODEL,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": str(judge_points(joke))}}],
                    }
                )

            def answer(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                with contextlib.suppress(OSError):  # the client gave up on a hung request
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True, name="soak-judge").start()

    def hang(self, seconds: float) -> None:
        self.hang_until = time.monotonic() + seconds

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()

"""Single-turn questions from any Hugging Face `datasets` source, answers checked by math-verify.

The source is a local Parquet/JSONL/CSV file (one split, "train"), a local directory of them (splits
named by file, e.g. train.jsonl and test.jsonl) or a hub dataset id. Each row gives a prompt column
and an answer column; items are the rows of `split` in a seeded shuffle, and `evaluate` draws from
`eval_split` when the source has one.

Reading answers: the model's final answer is the content of its last \\boxed{...}, else the last
number or expression math-verify finds in it ("so the answer is 1/2" -> 1/2). The gold answer is the
last \\boxed{...} of the answer column, else the whole column, read as LaTeX (a GSM8K solution
ending "#### 72" reads as 72). With answer_format "math" the reward is 1.0 when math-verify holds
them equal ("0.5", "1/2" and "\\frac{1}{2}" are one answer), else 0.0; with "text" when they match
ignoring case and spacing.

math-verify bounds its work with SIGALRM, which only a main thread may set, and rewards are also
computed in asyncio tasks and worker threads (Prefect's). So every math check runs in the main
thread of a child process, where those alarms stop runaway sympy work, and an answer the child
cannot settle within VERIFY_SECONDS scores 0.0 (the child is replaced).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from environments.answers import last_boxed
from environments.base import Environment, EnvironmentConfig, Item, final_answer

log = logging.getLogger(__name__)

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
PARSE_SECONDS = 2  # math-verify's own limit per parse and per comparison, in the child
VERIFY_SECONDS = 30.0  # beyond every limit above: only a child stuck in C code takes this long


class DatasetConfig(EnvironmentConfig):
    source: str = Field(
        description="A local .parquet/.jsonl/.json/.csv file, a directory of them, or a hub dataset id."
    )
    subset: str | None = Field(
        default=None, description="The dataset's configuration on the hub, e.g. 'main' of openai/gsm8k."
    )
    split: str = Field(default="train", description="The split items come from (a single file is split 'train').")
    eval_split: str = Field(
        default="test", description="The held-out split of `evaluate`; a source without it is sampled with eval_seed."
    )
    prompt_column: str = Field(
        default="prompt", description="Column of the question: a string, or chat messages used as is."
    )
    answer_column: str = Field(
        default="answer", description="Column of the gold answer, bare or a solution ending in it."
    )
    system_prompt: str | None = Field(default=None, description="A system message before the question; None: none.")
    prompt_template: str = Field(
        default="{prompt}\n\nPut your final answer in \\boxed{}.",
        description="The user message; {prompt} becomes the question.",
    )
    answer_format: Literal["math", "text"] = Field(
        default="math", description="math: equal by math-verify; text: equal ignoring case and spacing."
    )

    @field_validator("prompt_template")
    @classmethod
    def _has_prompt(cls, template: str) -> str:
        if "{prompt}" not in template:
            raise ValueError("prompt_template has no {prompt}; put {prompt} where the question goes")
        return template


def _parsed(text: str, gold: bool) -> list:
    from math_verify import parse

    boxed = last_boxed(text)
    if boxed is not None or gold:  # a bare gold answer is LaTeX ("6 - 5i" is not the number 5)
        found = parse(f"${text if boxed is None else boxed}$", parsing_timeout=PARSE_SECONDS)
        if found or boxed is not None:
            return found
    return parse(text, parsing_timeout=PARSE_SECONDS)


def _math_match(gold: str, answer: str) -> bool:
    from math_verify import verify

    return verify(_parsed(gold, gold=True), _parsed(answer, gold=False), timeout_seconds=PARSE_SECONDS)


def _math_gold(gold: str) -> str:
    found = _parsed(gold, gold=True)
    return str(found[-1]) if found else gold.strip()


def serve_math_checks() -> None:
    """The child's loop: one JSON request a line on stdin (["match", gold, answer] or ["gold",
    gold]), one JSON answer a line on stdout, until stdin closes."""
    for line in sys.stdin:
        kind, *texts = json.loads(line)
        try:
            verdict = _math_match(*texts) if kind == "match" else _math_gold(*texts)
        except Exception as error:  # noqa: BLE001 - math-verify catches its own; anything else must not end the loop
            print(f"math-verify on {texts[-1][:200]!r}: {type(error).__name__}: {error}", file=sys.stderr)
            verdict = None
        print(json.dumps(verdict), flush=True)


class MathChild:
    """The child process, asked one question at a time; a plain `python -c` rather than
    multiprocessing, which would re-import the caller's main script in the child."""

    def __init__(self):
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.owner = 0  # the pid that started it: a forked copy of this process starts its own

    def start(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None or self.owner != os.getpid():
            root = str(Path(__file__).resolve().parents[2])  # where `environments` is, installed or not
            path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from environments.bundled.dataset import serve_math_checks; serve_math_checks()",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": path},
            )
            self.owner = os.getpid()
        return self.process

    def ask(self, *request: str) -> Any:
        """The child's answer, or None when it gave none within VERIFY_SECONDS (it is replaced)."""
        with self.lock:
            process = self.start()
            try:
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                if select.select([process.stdout], [], [], VERIFY_SECONDS)[0]:
                    line = process.stdout.readline()
                    if line:
                        return json.loads(line)
            except BrokenPipeError:  # the child died; the next question starts a new one
                pass
            log.warning("math-verify gave no verdict on %r within %ss; scored 0", request[-1][:200], VERIFY_SECONDS)
            process.kill()
            process.wait()
            self.process = None
            return None


math_child = MathChild()
atexit.register(lambda: math_child.process and math_child.process.kill())


class SplitItems(Sequence):
    """A split's rows as Items, each made when the item stream asks for it (a split may be large)."""

    def __init__(self, rows: Any, make: Callable[[Any, int], Item]):
        self.rows, self.make = rows, make

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):  # the item stream asks by index only
        return self.make(self.rows, index)


def _normalized(text: str) -> str:
    boxed = last_boxed(text)
    return " ".join((text if boxed is None else boxed).split()).casefold()


class Dataset(Environment):
    """One row, one question: reward 1.0 when the final answer equals the row's answer, else 0.0."""

    name = "dataset"
    config_class = DatasetConfig

    async def setup(self) -> None:
        if self.config.answer_format == "math":
            with math_child.lock:
                math_child.start()  # it imports sympy while the data loads
        splits = self._load()
        config = self.config
        if config.split not in splits:
            raise ValueError(
                f"split: {config.source!r} has no split {config.split!r} (splits: {sorted(splits)}); set split to one of them"
            )
        held_out = splits.get(config.eval_split) if config.eval_split != config.split else None
        self.rows = {"train": splits[config.split], "eval": held_out}
        for rows in (rows for rows in self.rows.values() if rows is not None):
            for setting in ("prompt_column", "answer_column"):
                column = getattr(config, setting)
                if column not in rows.column_names:
                    raise ValueError(
                        f"{setting}: {config.source!r} split {rows.split} has no column {column!r} "
                        f"(columns: {rows.column_names}); set {setting} to the column that holds it"
                    )
            if len(rows) == 0:
                raise ValueError(f"source: {config.source!r} split {rows.split} has no rows")

    def items(self, split: str) -> SplitItems | None:
        """The configured split as "train", eval_split as "eval" (None without one: evaluate then
        draws from train with eval_seed); the base class hands them out."""
        rows = self.rows[split]
        return None if rows is None else SplitItems(rows, self._item)

    def _load(self) -> Any:
        import datasets

        source, path = self.config.source, Path(self.config.source).expanduser()
        local = path.exists() or path.suffix in _BUILDERS or source.startswith((".", "/", "~"))
        if local and not path.exists():
            raise FileNotFoundError(
                f"source: no file or directory {source!r}; give an existing path or a hub dataset id"
            )
        if path.is_file() and path.suffix not in _BUILDERS:
            raise ValueError(
                f"source: {source!r} is not a {'/'.join(_BUILDERS)} file; convert it or give a directory of them"
            )
        try:
            if path.is_file():
                return datasets.load_dataset(_BUILDERS[path.suffix], data_files={"train": str(path)})
            return datasets.load_dataset(str(path) if local else source, self.config.subset)
        except Exception as error:
            raise ValueError(
                f"source: cannot load {source!r} ({type(error).__name__}: {error}); give a local "
                ".parquet/.jsonl/.csv file, a directory of them, or a dataset id the hub can serve"
            ) from error

    def _item(self, rows: Any, index: int) -> Item:
        row, config = rows[index], self.config
        question = row[config.prompt_column]
        if isinstance(question, list):
            prompt = [dict(message) for message in question]
        else:
            prompt = [{"role": "user", "content": config.prompt_template.replace("{prompt}", str(question))}]
        if config.system_prompt is not None:
            prompt.insert(0, {"role": "system", "content": config.system_prompt})
        return Item(id=f"{rows.split}-{index}", prompt=prompt, answer=str(row[config.answer_column]))

    def reward(self, item: Item, messages: list[dict]) -> float:
        answer = final_answer(messages)
        if self.config.answer_format == "text":
            return float(bool(answer.strip()) and _normalized(answer) == _normalized(item.answer))
        return float(bool(answer.strip()) and math_child.ask("match", item.answer, answer) is True)

    def gold_completion(self, item: Item) -> str:
        gold = math_child.ask("gold", item.answer) if self.config.answer_format == "math" else None
        return f"\\boxed{{{gold or last_boxed(item.answer) or item.answer.strip()}}}"

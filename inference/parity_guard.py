"""The parity guard: served greedy logprobs on fixed prompts must equal a transformers forward pass."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from inference.client import PolicyClient
from inference.parity import load_reference_model, max_abs_difference, read_parity_reference, reference_logprobs

# Short prompts in the register of the bundled environments; tokenized once with the run's tokenizer.
DEFAULT_PROMPTS = (
    "What is 12 + 7? Give only the final answer.",
    "Guess a number between 1 and 50. You have 5 tries left.",
    "The answer is",
)
# Largest |served - reference| logprob accepted, by the dtype vLLM serves in. fp32 agrees to ~1e-6 on
# CPU (NOTES.md). bf16, measured by bench/bench_scale.py (parity_noise, vLLM-CPU) at the real shapes:
# the same weights differ from the reference a trainer stores (computed in bf16) by up to 0.002 (one
# run at 0.5B: 0.063 on one token of 35, mean 0.0026), from an fp32 forward (the reference of an
# outside model) by up to 0.03-0.07; another seed's weights by 1.4-1.5 (mean 0.46-0.56). 0.25 sits
# between. float16 (3 more mantissa bits) is not measured here: every check logs its maximum.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25, "float16": 2e-2}


REFERENCE_WORDS = {"transformers": "a transformers forward pass of", "stored": "the trainer's logprobs stored with"}


class ParityMismatch(RuntimeError):
    """The served logprobs differ from the checkpoint's (stored with it, or a transformers forward pass)."""

    def __init__(self, message: str, report: ParityReport):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class ParityReport:
    """One parity check: the largest logprob difference over every prompt and token."""

    checkpoint_dir: str
    max_difference: float
    tolerance: float
    tokens: int
    seconds: float
    reference: str = "transformers"  # or "stored": the trainer's logprobs kept with the checkpoint

    @property
    def passed(self) -> bool:
        # NaN fails: a policy that produces NaN logprobs is broken whatever the reference says.
        return math.isfinite(self.max_difference) and self.max_difference <= self.tolerance


def default_prompt_ids(tokenizer) -> list[list[int]]:
    """DEFAULT_PROMPTS as token ids: the guard's prompts, and the sequences a trainer stores its
    parity reference for (trainer.publishing)."""
    return [tokenizer.encode(text, add_special_tokens=False) for text in DEFAULT_PROMPTS]


def worst_difference(pairs) -> float:
    """The largest |served - reference| over (served, reference) logprob lists; NaN if any is NaN."""
    worst = 0.0
    for served, reference in pairs:
        difference = max_abs_difference(served, reference)
        worst = difference if math.isnan(difference) else max(worst, difference)
    return worst


def tolerance_for(dtype: str) -> float:
    try:
        return TOLERANCE[dtype]
    except KeyError:
        raise ValueError(
            f"no parity tolerance for dtype {dtype!r}; use one of {sorted(TOLERANCE)} or pass tolerance="
        ) from None


class ParityGuard:
    """Compares a server's greedy completions with the checkpoint it should be serving.

    Reference models are cached (the newest two: the checkpoint being loaded and the one a fallback
    returns to), so checking several servers against one checkpoint loads it once.
    """

    def __init__(
        self,
        prompts: list[list[int]],
        *,
        tolerance: float = TOLERANCE["float32"],
        max_tokens: int = 8,
        model_name: str = "policy",
    ):
        if not prompts or not all(prompts):
            raise ValueError("ParityGuard needs at least one non-empty token-id prompt")
        self.prompts = [list(prompt) for prompt in prompts]
        self.tolerance = tolerance
        self.max_tokens = max_tokens
        self.model_name = model_name
        self._models: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # not asyncio's: a guard may serve several event loops

    @classmethod
    def for_model(cls, model_dir: str | Path, *, dtype: str = "float32", **kwargs) -> ParityGuard:
        """A guard over DEFAULT_PROMPTS tokenized with the model's tokenizer, tolerance by dtype."""
        from transformers import AutoTokenizer

        kwargs.setdefault("tolerance", tolerance_for(dtype))
        return cls(default_prompt_ids(AutoTokenizer.from_pretrained(model_dir)), **kwargs)

    def reference_model(self, checkpoint_dir: str | Path):
        key = str(Path(checkpoint_dir).resolve())
        with self._lock:
            if key not in self._models:
                self._models[key] = load_reference_model(key)
                while len(self._models) > 2:
                    self._models.popitem(last=False)
            self._models.move_to_end(key)
            return self._models[key]

    async def measure(self, client: PolicyClient, checkpoint_dir: str | Path, *, priority: int = 0) -> ParityReport:
        """The server's logprobs against the checkpoint's own: the reference stored with it by the
        trainer (teacher-forced sequences: one short request each, no model here), else greedy
        completions of every prompt scored by a transformers forward pass of the checkpoint.
        `priority` (inference.server.URGENT where the server schedules by priority) puts the
        requests before the generation waiting: the check is on the critical path of a version."""
        started = time.perf_counter()
        stored = read_parity_reference(checkpoint_dir)
        if stored is not None:
            sequences, references = stored
            served = await asyncio.gather(
                *(client.prompt_logprobs(sequence, priority=priority) for sequence in sequences)
            )
            # The first token of each: nothing predicts it.
            worst = worst_difference(zip([logprobs[1:] for logprobs in served], references, strict=True))
            tokens = sum(len(reference) for reference in references)
            return ParityReport(
                str(checkpoint_dir), worst, self.tolerance, tokens, time.perf_counter() - started, "stored"
            )
        model = await asyncio.to_thread(self.reference_model, checkpoint_dir)
        batches = await asyncio.gather(
            *(
                client.complete(prompt, max_tokens=self.max_tokens, temperature=0.0, priority=priority)
                for prompt in self.prompts
            )
        )
        completions = [completion for [completion] in batches]
        references = [
            await asyncio.to_thread(reference_logprobs, model, prompt, completion.token_ids)
            for prompt, completion in zip(self.prompts, completions)
        ]
        worst = worst_difference(zip([completion.logprobs for completion in completions], references))
        tokens = sum(len(completion.token_ids) for completion in completions)
        return ParityReport(str(checkpoint_dir), worst, self.tolerance, tokens, time.perf_counter() - started)

    async def check(self, client: PolicyClient, checkpoint_dir: str | Path, *, priority: int = 0) -> ParityReport:
        """measure(), raising ParityMismatch when the difference is above the tolerance."""
        report = await self.measure(client, checkpoint_dir, priority=priority)
        if not report.passed:
            raise ParityMismatch(
                f"parity check failed at {client.base_url}: served logprobs differ from "
                f"{REFERENCE_WORDS[report.reference]} {checkpoint_dir} by up to {report.max_difference:.3g} "
                f"(tolerance {report.tolerance:g}, {report.tokens} tokens)",
                report,
            )
        return report

"""How a sequence's tokens were drawn (ScoredSequence.sampling) and what the trainer needs of it to
score the same distribution."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

# vLLM's --logprobs-mode values: what a server's sampled-token "logprobs" are. processed_logprobs
# are of the distribution that drew the token (after temperature, min_p, top-k and top-p, the kept
# set renormalised); raw_logprobs (vLLM's default) are of the model before any of them.
LogprobsMode = Literal["processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)
# vLLM samples greedily below this temperature, and then scales nothing (vllm/v1/sample/sampler.py).
GREEDY_BELOW = 1e-5


class Sampling(BaseModel):
    """How a sequence's sampled tokens were drawn: the parameters its requests sent and the server's
    logprobs mode. The trainer scores each sequence under the distribution its sampler's logprobs
    are of (logprob_temperature)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass; 1 keeps every token.")
    top_k: int | None = Field(default=None, ge=1, description="Most likely tokens kept; None keeps every one.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Tokens below min_p x the top probability dropped.")
    logprobs_mode: LogprobsMode | None = Field(
        default=None,
        description="What the server's logprobs are (vLLM's --logprobs-mode): processed_logprobs, of the "
        "distribution that drew the tokens; raw_logprobs, of the model before temperature and truncation; "
        "None where the server did not say (vLLM without VLLM_SERVER_DEV_MODE's /server_info).",
    )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def logprob_temperature(self) -> float:
        """The temperature the sampler's logprobs are at, the one the trainer divides the logits by:
        the sampling temperature for processed logprobs, 1 for raw ones or greedy sampling (which vLLM
        does not scale)."""
        return self.temperature if self.logprobs_mode == "processed_logprobs" and not self.greedy else 1.0


def policy_gradient_problems(sampling: Sampling | None) -> list[str]:
    """Why the trainer's logprobs of a sequence drawn with `sampling` could not be of the
    distribution its sampler's logprobs are of, as 'sampling.field: what; fix' lines: what a
    policy-gradient objective (rl, distill) needs, since its importance ratio divides one by the
    other. Unset sampling means temperature 1 and no truncation. The pipeline's config asks it of
    each environment's settings before a run starts (flows.pipeline_config)."""
    if sampling is None or sampling.greedy:
        return []
    found = []
    for name, neutral in (("top_p", 1.0), ("top_k", None), ("min_p", 0.0)):
        value = getattr(sampling, name)
        if value != neutral:
            found.append(
                f"sampling.{name}: {value} truncates the distribution that drew the tokens and the trainer "
                f"does not; sample policy-gradient groups with {name} {neutral} (--set {name}={neutral}) or "
                "train them as sft"
            )
    mode = sampling.logprobs_mode
    if mode is not None and mode.endswith("_logits"):
        found.append(
            f"sampling.logprobs_mode: {mode}: the server returned logits, not logprobs; start it with "
            "--logprobs-mode processed_logprobs (clotho serve does)"
        )
    elif mode is None and sampling.temperature != 1.0:
        found.append(
            f"sampling.logprobs_mode: unknown at temperature {sampling.temperature:g}, so the sampler's logprobs "
            "may be of the model or of the tempered distribution; sample with a server clotho starts "
            "(clotho serve: --logprobs-mode processed_logprobs, /server_info) or at temperature 1"
        )
    return found

"""The Atropos adapter's backend: ClothoServer, an atroposlib APIServer whose chat, completion and
tokens-and-logprobs calls go to clotho's policy server in token ids through the environment's
PolicyClient (environments.adapters.atropos builds the BaseEnv with it as its one server). Every
completion it returns while a group is collected is recorded in `SAMPLED` (prompt ids, completion),
which the adapter reads to check the group's token-exactness.
"""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from typing import Any

from atroposlib.envs.server_handling.server_baseline import APIServer
from openai.types.chat.chat_completion import ChatCompletion, ChatCompletionMessage, Choice
from openai.types.completion import Completion as OpenAICompletion
from openai.types.completion_choice import CompletionChoice
from tenacity import stop_after_attempt

from environments.chat import ChatRenderer
from inference.client import Completion, PolicyClient, PolicyServerError

# The completions the backend returned while the current group was collected: (prompt ids, completion).
SAMPLED: contextvars.ContextVar[list[tuple[tuple[int, ...], Completion]] | None] = contextvars.ContextVar(
    "clotho_atropos_sampled", default=None
)
SAMPLING_ARGS = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "min_tokens",
    "stop_token_ids",
)
MAX_TOKENS_ALIASES = ("max_new_tokens", "max_completion_tokens")

log = logging.getLogger(__name__)


# Atropos retries every call 3 x 3 times; PolicyClient already retries what a retry can fix, and an
# unreachable server must reach clotho as itself (it stops or pauses the run), not as a RetryError.
_ONCE = dict(stop=stop_after_attempt(1), reraise=True)


class ClothoServer(APIServer):
    """Atropos's model calls answered by clotho's policy server, in token ids."""

    _chat_comp = APIServer._chat_comp.retry_with(**_ONCE)
    _chat_eval = APIServer._chat_eval.retry_with(**_ONCE)
    chat_completion = APIServer.chat_completion.retry_with(**_ONCE)
    _comp = APIServer._comp.retry_with(**_ONCE)
    _comp_eval = APIServer._comp_eval.retry_with(**_ONCE)
    _tokens_and_logprobs_comp = APIServer._tokens_and_logprobs_comp.retry_with(**_ONCE)
    _tokens_and_logprobs_comp_eval = APIServer._tokens_and_logprobs_comp_eval.retry_with(**_ONCE)

    def bind(
        self, client: PolicyClient, tokenizer, *, default_max_tokens: int, greedy: bool, cap: bool = False
    ) -> None:
        """`cap`: default_max_tokens is also the most any request may ask for (the config set it)."""
        self.client, self.tokenizer = client, tokenizer
        self.default_max_tokens, self.greedy, self.cap = default_max_tokens, greedy, cap
        self.context: int | None = None  # the served model's max_model_len (Atropos.fit_context sets it)
        self.clamped = False
        self.turn_end = turn_end_tokens(tokenizer)

    def fitted(self, prompt_ids: list[int], max_tokens: int, after: int = 0) -> int:
        """`max_tokens` within what the served model's context leaves after the prompt. Atropos
        environments size their requests for the model they were written for (max_token_length
        8192 and up); served a model with a shorter context, vLLM refuses every such request,
        so it is cut to fit, said once. The room left is for the stored sequence as the adapter
        scores it (inference.client.prompt_logprobs: at most the context less one token) with the
        `after` tokens the environment's chat template closes a reply with (<|im_end|> and a newline
        in ChatML): a reply that runs to the limit still fits."""
        if not self.context:
            return max_tokens
        room = self.context - 1 - after - len(prompt_ids)
        if max_tokens <= room:
            return max_tokens
        if room < 1:
            raise PolicyServerError(
                f"the prompt is {len(prompt_ids)} tokens, leaving no room for a reply in the served model's context "
                f"(max_model_len {self.context})"
            )
        if not self.clamped:
            self.clamped = True
            log.warning(
                "the Atropos environment asks for up to %d tokens; the served model's context (max_model_len %d) "
                "leaves %d after a %d-token prompt: sampling up to that",
                max_tokens,
                self.context,
                room,
                len(prompt_ids),
            )
        return room

    async def check_server_status_task(self, chat_completion: bool = True) -> None:
        self.server_healthy = True  # PolicyClient waits for the server and says when it is gone

    async def _sample(self, prompt_ids: list[int], kwargs: dict[str, Any], after: int = 0) -> list[Completion]:
        kwargs = dict(kwargs)
        kwargs.pop("model", None)
        for alias in MAX_TOKENS_ALIASES:
            if alias in kwargs:
                kwargs["max_tokens"] = kwargs.pop(alias)
        unsupported = sorted(set(kwargs) - set(SAMPLING_ARGS))
        if unsupported:
            raise PolicyServerError(f"clotho's policy client takes {', '.join(SAMPLING_ARGS)}; not {unsupported}")
        sampling = {"max_tokens": self.default_max_tokens, **{k: v for k, v in kwargs.items() if v is not None}}
        if isinstance(sampling.get("stop"), str):
            sampling["stop"] = [sampling["stop"]]
        if self.greedy:
            sampling["temperature"] = 0.0
        requested = int(sampling["max_tokens"])
        if self.cap:
            requested = min(requested, self.default_max_tokens)
        sampling["max_tokens"] = self.fitted(prompt_ids, requested, after)
        completions = await self.client.complete(prompt_ids, **sampling)
        if (sampled := SAMPLED.get()) is not None:
            sampled.extend((tuple(prompt_ids), completion) for completion in completions)
        return completions

    def _text(self, completion: Completion) -> tuple[str, str]:
        if completion.finish_reason == "abort":
            raise PolicyServerError("the policy server aborted the request (a weight reload with mode=abort?)")
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True), completion.finish_reason

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs) -> tuple[list, list, list, list]:
        prompt = kwargs.pop("prompt", None)
        prompt_ids = kwargs.pop("input_ids", None)
        if prompt_ids is None:  # as VLLMServer: the text with the tokenizer's special tokens, one BOS
            prompt_ids = self.tokenizer.encode(prompt)
            bos = self.tokenizer.bos_token_id
            if len(prompt_ids) >= 2 and bos is not None and prompt_ids[0] == bos == prompt_ids[1]:
                prompt_ids = prompt_ids[1:]
        completions = await self._sample(list(prompt_ids), kwargs)
        return (
            list(prompt_ids),
            [c.token_ids for c in completions],
            [c.logprobs for c in completions],
            [c.finish_reason for c in completions],
        )

    async def _completion_wrapper(self, **kwargs) -> OpenAICompletion:
        prompt = kwargs.pop("prompt")
        completions = await self._sample(self.tokenizer.encode(prompt), kwargs)
        choices = [
            CompletionChoice(index=i, text=text, finish_reason=finish)
            for i, (text, finish) in enumerate(map(self._text, completions))
        ]
        return OpenAICompletion(
            id=str(uuid.uuid4()),
            created=int(time.time()),
            model=self.config.model_name,
            object="text_completion",
            choices=choices,
        )

    async def _chat_completion_wrapper(self, **kwargs) -> ChatCompletion:
        messages, tools = kwargs.pop("messages"), kwargs.pop("tools", None)
        rendered = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        completions = await self._sample(
            self.tokenizer.encode(rendered, add_special_tokens=False), kwargs, self.turn_end
        )
        choices = [
            Choice(index=i, finish_reason=finish, message=ChatCompletionMessage(role="assistant", content=text))
            for i, (text, finish) in enumerate(map(self._text, completions))
        ]
        return ChatCompletion(
            id=str(uuid.uuid4()),
            created=int(time.time()),
            model=self.config.model_name,
            object="chat.completion",
            choices=choices,
        )


def turn_end_tokens(tokenizer) -> int:
    """How many tokens the tokenizer's chat template puts after an assistant reply's text
    (ChatRenderer.turn_end: 2 in ChatML, <|im_end|> and a newline); 0 when it cannot tell (no
    template, or one that drops the reply it is given)."""
    try:
        closing = ChatRenderer(tokenizer).turn_end
    except Exception:  # noqa: BLE001 (no chat template, one that refuses the probe, or no reply in what it renders)
        return 0
    return len(tokenizer.encode(closing, add_special_tokens=False))

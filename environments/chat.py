"""Chat rendering into token ids and multi-turn sessions that grow one token sequence."""

from __future__ import annotations

import threading
from functools import cached_property
from typing import Any

from environments.trajectory import Trajectory
from inference.client import Completion, PolicyClient

Messages = list[dict[str, Any]]

# A string no template alters, to find where an assistant message's content sits in a rendering.
_SENTINEL = "\x00clotho-sentinel\x00"


_import_lock = threading.Lock()


def load_tokenizer(path: str):
    """The policy's tokenizer, from a local directory or any HF id already on disk."""
    # transformers resolves its names lazily, and two threads doing that first import at once can
    # fail with ImportError (seen in Dask worker threads); one at a time.
    with _import_lock:
        from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class ChatRenderer:
    """Renders messages with a chat template (the environment's own or the tokenizer's) to ids.

    Generated text is never re-tokenized: only the template's own text (headers, turn ends, new
    user/tool turns) is encoded, and sampled ids are appended untouched by the session.
    """

    def __init__(
        self,
        tokenizer,
        chat_template: str | None = None,
        template_name: str | None = None,
        variables: dict[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_name = template_name if chat_template else None
        # Names the template reads besides the messages, e.g. a group chat's next speaker, which
        # its generation prompt writes and no message holds yet.
        self.variables = dict(variables or {})
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; give the environment a chat_template or use "
                "base-model completion (Environment.complete_text)"
            )

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.variables,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def prompt_ids(self, messages: Messages) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    @cached_property
    def turn_end(self) -> str:
        """What the template writes after an assistant message's content (ChatML: '<|im_end|>\\n')."""
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
        rendered = self.render(probe)
        return rendered[rendered.rindex(_SENTINEL) + len(_SENTINEL) :]

    def closing_ids(self, completion: Completion) -> list[int]:
        """Context ids that close an assistant turn the model stopped (or was cut off) in.

        A turn that stopped on EOS already holds the turn-end token; a length-stopped turn gets the
        whole turn end as untrained context, so no fake EOS is ever trained.
        """
        text = self.turn_end
        eos = self.eos_token_id
        if completion.finish_reason == "stop" and completion.token_ids and completion.token_ids[-1] == eos:
            eos_text = self.tokenizer.convert_ids_to_tokens(eos)
            if text.startswith(eos_text):
                text = text[len(eos_text) :]
        return self.encode(text) if text else []

    def continuation_ids(self, history: Messages, new_messages: Messages) -> list[int]:
        """Ids of the new (user/tool/environment) turns plus the next assistant header."""
        before = self.render(history)
        after = self.render(history + new_messages, add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template rewrites earlier turns when a message is added, so a growing "
                "token sequence cannot follow it; use a template that only appends (e.g. ChatML)"
            )
        return self.encode(after[len(before) :])


class ChatSession:
    """One multi-turn conversation kept as one token sequence, ready to become a ScoredSequence."""

    def __init__(self, renderer: ChatRenderer, messages: Messages):
        self.renderer = renderer
        self.messages: Messages = [dict(m) for m in messages]
        self.trajectory = Trajectory()
        self.trajectory.add_context(renderer.prompt_ids(self.messages))
        self._turn_open = True
        self._last: Completion | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.trajectory.tokens

    async def sample(self, client: PolicyClient, **sampling: Any) -> Completion:
        """Samples the assistant's next turn from the exact ids so far and records it."""
        [completion] = await client.complete(self.prompt_ids, n=1, **sampling)
        self.add_completion(completion)
        return completion

    def add_completion(self, completion: Completion) -> None:
        if not self._turn_open:
            raise RuntimeError("add a user/tool message before sampling another assistant turn")
        self.trajectory.add_sampled(completion)
        self.messages.append({"role": "assistant", "content": self.renderer.decode(completion.token_ids)})
        self._last = completion
        self._turn_open = False

    def add_messages(self, new_messages: Messages) -> None:
        """Closes the last assistant turn, appends environment/tool/user turns (masked out) and
        opens the next assistant turn. The final turn is never closed, so a sequence ends on the
        model's own last token."""
        if self._last is not None:
            self.trajectory.add_context(self.renderer.closing_ids(self._last))
            self._last = None
        self.trajectory.add_context(self.renderer.continuation_ids(self.messages, new_messages))
        self.messages.extend(dict(m) for m in new_messages)
        self._turn_open = True

    def to_sequence(self, score: float, **fields: Any):
        return self.trajectory.to_sequence(score, messages=self.messages, **fields)

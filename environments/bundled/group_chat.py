"""Group chat: named participants schedule a meeting; the policy speaks for the organisers.

The scripted attendees say when they are free; each organiser the policy speaks for proposes an
hour as `PROPOSE <hour>` and every attendee answers whether it suits them, until the proposal
suits all or the organiser's `rounds` are spent. Turns are rendered with the environment's own
template, one `[name]: text` line per turn:

    * Group chat: find one hour ... Organisers: dave.
    [alice]: I am free at 9, 13, 15.<eos>
    [bob]: I am free at 11, 13, 16.<eos>
    [dave]: PROPOSE 13<eos>
    [alice]: 13 works for me.<eos>

A game is one conversation; each organiser is one sequence of the group, seen from its side: its
own turns have role "assistant" (trained, sampled from exactly that sequence's ids) and every
other participant's, the other organisers' included, role "user" (context); a message's "name"
says who speaks. Reward: the share of attendees free at the organiser's last proposed hour.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from pydantic import Field

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import Environment, EnvironmentConfig, Item, final_answer, prompt_messages
from environments.chat import ChatRenderer, ChatSession, Messages

NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
HOURS = range(9, 17)  # meetings start on the hour, 9 to 16
_PROPOSE = re.compile(r"PROPOSE\s+(\d{1,2})\b")

# Every turn ends on the tokenizer's EOS: the token the server stops a sampled turn at. The
# generation prompt names the next speaker, given as the renderer's `speaker` variable.
GROUP_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ '* ' + message['content'] + '\n' }}"
    "{%- else -%}{{ '[' + (message.get('name') or message['role']) + ']: ' + message['content'] + eos_token + '\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if speaker is not defined -%}"
    "{{ raise_exception('group chat template: say who speaks next, ChatRenderer(..., variables={\"speaker\": name})') }}"
    "{%- endif -%}"
    "{{ '[' + speaker + ']: ' }}"
    "{%- endif -%}"
)


class GroupChatConfig(EnvironmentConfig):
    attendees: int = Field(default=2, ge=1, le=4, description="Scripted participants who say when they are free.")
    policy_speakers: int = Field(
        default=1, ge=1, le=4, description="Organisers the policy speaks for; each is one sequence of a game."
    )
    rounds: int = Field(default=2, ge=1, description="Proposals each organiser may make in a game.")


def proposed_hour(text: str) -> int | None:
    match = _PROPOSE.search(text)
    return int(match.group(1)) if match else None


def seen_by(speaker: str, message: dict) -> dict:
    """A message as `speaker`'s sequence holds it: its own turns are the trained (assistant) ones."""
    return dict(message, role="assistant") if message.get("name") == speaker else dict(message)


class GroupChat(Environment):
    """group_size sequences: ceil(group_size / policy_speakers) games, one sequence per organiser
    (evaluate's group of one keeps the first organiser's)."""

    name = "group_chat"
    config_class = GroupChatConfig
    chat_template = GROUP_CHAT_TEMPLATE
    chat_template_name = "group_chat"

    def new_item(self, rng: random.Random, index: int) -> dict[str, Any]:
        config = self.config
        names = rng.sample(NAMES, config.attendees + config.policy_speakers)
        attendees, speakers = names[: config.attendees], names[config.attendees :]
        meeting = rng.choice(HOURS)  # one hour that suits everyone, so every game can be won
        others = [hour for hour in HOURS if hour != meeting]
        free = {name: sorted([meeting, *rng.sample(others, 2)]) for name in attendees}
        system = (
            f"Group chat: find one hour from {HOURS[0]} to {HOURS[-1]} when every attendee is free. "
            f"An organiser proposes with PROPOSE <hour>. Organisers: {', '.join(speakers)}."
        )
        prompt = [{"role": "system", "content": system}] + [
            {"role": "user", "name": name, "content": f"I am free at {', '.join(map(str, hours))}."}
            for name, hours in free.items()
        ]
        return dict(
            prompt=prompt,
            answer=sorted(set(HOURS).intersection(*free.values())),
            extras={"free": free, "speakers": speakers},
        )

    def reward(self, item: Item, messages: Messages) -> float:
        hour = proposed_hour(final_answer(messages))
        free = item.extras["free"]
        return sum(hour in hours for hours in free.values()) / len(free)

    def gold_completion(self, item: Item) -> str:
        return f"PROPOSE {item.answer[0]}"

    def replies(self, item: Item, text: str) -> Messages:
        """The attendees' answers to an organiser's turn (context of every sequence)."""
        hour = proposed_hour(text)
        free = item.extras["free"]
        if hour is None:
            return [{"role": "user", "name": next(iter(free)), "content": "Please propose an hour: PROPOSE <hour>."}]
        return [
            {
                "role": "user",
                "name": name,
                "content": f"{hour} works for me." if hour in hours else f"I can't make {hour}.",
            }
            for name, hours in free.items()
        ]

    async def play_game(self, item: Item) -> list[ScoredSequence]:
        game = Game(self, item)
        for _ in range(self.config.rounds):
            for speaker in item.extras["speakers"]:
                if speaker not in game.agreed:
                    await game.session_for(speaker).sample(self.client, **self.sampling())
                    game.record(speaker)
        return game.sequences()

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        games = math.ceil(self.config.group_size / self.config.policy_speakers)
        # gather_sequences records a failed game as one error; each finished game is a list.
        played, errors = await self.gather_sequences([self.play_game(item) for _ in range(games)])
        sequences = [sequence for game in played for sequence in game]
        return self.make_group(item, sequences[: self.config.group_size], errors=errors)


class Game:
    """One conversation in progress: the shared record, and each organiser's own session of it
    from which its turns are sampled (so its sequence holds exactly the ids the policy saw)."""

    def __init__(self, env: GroupChat, item: Item):
        self.env, self.item = env, item
        self.conversation = prompt_messages(item)  # every turn role "user", named
        self.sessions: dict[str, ChatSession] = {}
        self.heard: dict[str, int] = {}  # how much of the conversation each session holds
        self.agreed: set[str] = set()  # organisers whose proposal suits everyone: done

    def session_for(self, speaker: str) -> ChatSession:
        """speaker's session, given every turn since its last one, open for its next turn."""
        news = [seen_by(speaker, message) for message in self.conversation[self.heard.get(speaker, 0) :]]
        if speaker in self.sessions:
            self.sessions[speaker].add_messages(news)
        else:
            env = self.env
            renderer = ChatRenderer(env.tokenizer, env.chat_template, env.chat_template_name, {"speaker": speaker})
            self.sessions[speaker] = ChatSession(renderer, news)
        return self.sessions[speaker]

    def record(self, speaker: str) -> None:
        """Names speaker's sampled turn and adds it, with the attendees' replies, to the record."""
        session = self.sessions[speaker]
        session.messages[-1]["name"] = speaker
        text = session.messages[-1]["content"]
        self.conversation.append({"role": "user", "name": speaker, "content": text})
        self.heard[speaker] = len(self.conversation)
        self.conversation += self.env.replies(self.item, text)
        if self.env.reward(self.item, session.messages) == 1.0:
            self.agreed.add(speaker)

    def sequences(self) -> list[ScoredSequence]:
        return [
            session.to_sequence(
                self.env.reward(self.item, session.messages),
                extras={"speaker": speaker, "turns": session.trajectory.turns},
            )
            for speaker, session in self.sessions.items()
        ]

"""TextArena games played by the policy against itself: one game, one multi-agent group.

Every seat the policy plays is one sequence of the group, seen from that seat: its observations
are user turns (context, untrained) and its moves are sampled from exactly the ids of its own
conversation (trained). A seat may instead be a fixed opponent, a simple built-in player that is
neither trained nor in the group. group_size = policy seats x games: every game of a group plays
the same item (one game id, one seed), as GRPO's samples share one prompt.

    config {"game": "TicTacToe-v0", "group_size": 4}     -> 2 games, 4 sequences (seats 0 and 1)
    config {..., "opponent_seats": [0], "group_size": 2} -> 2 games, seat 1's 2 sequences

A seat hears only what is new since its last move (the game's own messages, `[sender] text` as
TextArena's LLMObservationWrapper writes them): TextArena's observation wrappers repeat the whole
history every turn for stateless agents, which a growing conversation already holds. The game's
action wrappers (bracketing, clipping) still apply to the moves. Invalid moves are the game's to
handle: it warns, penalizes or ends the game as its rules say.

Rewards are the game's own, env.close()'s per-player dict. After the game each seat's messages
get one closing user message (never tokens: nothing is sampled after it, so the sequence ends on
the seat's own last move): what the seat had not yet seen, the game's reason, and
"Your reward: R", from which `reward` reads the score again. A game still running after
max_turns moves is stopped and scores 0 for every seat (a draw); group extras["games"] records,
per game, the rewards, whether it finished, the moves made, TextArena's game info and the seats
that never got a turn (no trained token, so no sequence: in TicTacToe a first player that fails
twice ends the game before the second moves).
"""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

import textarena as ta
from pydantic import Field, model_validator
from textarena.envs.registration import ENV_REGISTRY

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import Environment, EnvironmentConfig, Item
from environments.chat import ChatSession, Messages

_RESULT = re.compile(r"Your reward: (\S+)\Z")
# The line of an observation that lists the legal moves, e.g. TicTacToe's "Available Moves: '[0]', '[4]'".
_MOVE_LIST = re.compile(r"(?:available moves|valid moves|available actions)[^:\n]*:([^\n]*)", re.IGNORECASE)
_BRACKETED = re.compile(r"\[[^\[\]]+\]")
# Player counts tried, in order, when the config does not say: the fewest players the game takes.
PLAYER_COUNTS = (2, 3, 4, 5, 6, 7, 8, 1)


class TextArenaConfig(EnvironmentConfig):
    game: str = Field(default="TicTacToe-v0", description="A TextArena game id (ta.make).")
    num_players: int | None = Field(
        default=None, ge=1, description="Seats at the table; default: the fewest players the game accepts."
    )
    opponent_seats: list[int] = Field(
        default_factory=list,
        description="Seats played by the fixed opponent instead of the policy (not trained, not in the group).",
    )
    opponent_move: str = Field(
        default="[pass]",
        description="What the fixed opponent plays when its observation lists no moves to pick from at random.",
    )
    max_turns: int = Field(
        default=100, ge=1, description="Moves after which a running game is stopped and scores 0 (a draw)."
    )

    @model_validator(mode="after")
    def _check_table(self) -> TextArenaConfig:
        if self.game not in ENV_REGISTRY:
            raise ValueError(
                f"game {self.game!r} is not a TextArena game id ({len(ENV_REGISTRY)} registered, e.g. "
                "TicTacToe-v0, SimpleNegotiation-v0-short, IteratedPrisonersDilemma-v0)"
            )
        if self.num_players is None:
            self.num_players = next((count for count in PLAYER_COUNTS if accepts(self.game, count)), None)
            if self.num_players is None:
                raise ValueError(f"game {self.game!r} takes none of {PLAYER_COUNTS} players; set num_players")
        elif not accepts(self.game, self.num_players):
            raise ValueError(f"num_players {self.num_players}: {self.game} does not take {self.num_players} players")
        seats = range(self.num_players)
        if any(seat not in seats for seat in self.opponent_seats) or len(set(self.opponent_seats)) != len(
            self.opponent_seats
        ):
            raise ValueError(f"opponent_seats {self.opponent_seats}: give distinct seats of 0..{self.num_players - 1}")
        policy = len(self.policy_seats)
        if policy == 0:
            raise ValueError(f"opponent_seats {self.opponent_seats} fill every seat; leave at least one to the policy")
        if self.group_size % policy:
            raise ValueError(
                f"group_size {self.group_size}: a group is whole games, policy seats ({policy}) x games; "
                f"use a multiple of {policy}"
            )
        return self

    @property
    def policy_seats(self) -> list[int]:
        return [seat for seat in range(self.num_players or 0) if seat not in self.opponent_seats]


class GameItem(Item):
    game: str = Field(description="The TextArena game id.")
    game_seed: int = Field(description="The seed the game is reset with.")


def accepts(game: str, players: int) -> bool:
    """Whether the game's reset takes this many players (games assert their own counts)."""
    env = ta.make(game)
    outer = random.getstate()  # reset seeds the global random
    try:
        env.reset(num_players=players, seed=0)
    except Exception:  # noqa: BLE001 - games refuse a player count by asserts or errors of their own
        return False
    finally:
        random.setstate(outer)
    return True


def as_json(value: Any) -> Any:
    """TextArena's info with string keys and plain values, so it survives a shard unchanged."""
    return json.loads(json.dumps(value, default=str))


class Game:
    """One game in progress: TextArena's env and each policy seat's conversation of it."""

    def __init__(self, config: TextArenaConfig, seed: int):
        self.env = ta.make(config.game)
        self.raw = self.env
        while isinstance(self.raw, ta.Wrapper):  # observations come unwrapped, moves go through the wrappers
            self.raw = self.raw.env
        self.random_state = random.Random(seed).getstate()
        self.run(self.env.reset, num_players=config.num_players, seed=seed)
        self.sessions: dict[int, ChatSession] = {}
        self.moves = 0
        self.done = False

    def run(self, call, *args, **kwargs) -> Any:
        """Calls TextArena on this game's own `random` state: TextArena seeds and draws from the
        global one, so concurrent games would otherwise draw from each other's streams."""
        outer = random.getstate()
        random.setstate(self.random_state)
        try:
            return call(*args, **kwargs)
        finally:
            self.random_state = random.getstate()
            random.setstate(outer)

    def observe(self) -> tuple[int, list[tuple]]:
        """The seat to move and what it has not seen yet (TextArena clears it once read)."""
        return self.run(self.raw.get_observation)

    def text(self, observation: list[tuple]) -> str:
        names = self.raw.state.role_mapping
        return "\n".join(
            f"[{'GAME' if sender == ta.GAME_ID else names.get(sender, f'Player {sender}')}] {message}"
            for sender, message, _ in observation
        )

    def move(self, action: str) -> None:
        self.done, _ = self.run(self.env.step, action)
        self.moves += 1

    def close(self) -> tuple[dict[int, float], dict[str, Any]]:
        rewards, game_info = self.run(self.env.close)
        return {seat: float(reward) for seat, reward in (rewards or {}).items()}, as_json(game_info)

    def closing(self, seat: int, score: float, game_info: dict[str, Any]) -> dict[str, str]:
        """The seat's last message: what it had not seen yet, how the game ended, its reward."""
        if self.done:
            outcome = f"[GAME] Game over. {game_info.get(str(seat), {}).get('reason', '')}".rstrip()
        else:
            outcome = f"[GAME] The game was stopped unfinished after {self.moves} moves: a draw."
        unseen = self.text(self.raw.state.observations.get(seat, []))
        return {
            "role": "user",
            "content": "\n".join(part for part in (unseen, outcome, f"Your reward: {score!r}") if part),
        }


def fixed_opponent_move(observation: list[tuple], fallback: str, rng: random.Random) -> str:
    """The fixed opponent: a random move of the last move list it was shown, else `fallback`."""
    for _, message, _ in reversed(observation):
        for moves in reversed(_MOVE_LIST.findall(str(message))):
            if choices := _BRACKETED.findall(moves):
                return rng.choice(choices)
    return fallback


class TextArena(Environment):
    """TextArena self-play: ceil(group_size / policy seats) games of one seeded item, one sequence
    per policy seat that moved (evaluate's group of one keeps the first)."""

    name = "textarena"
    config_class = TextArenaConfig
    item_class = GameItem

    async def setup(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.count = 0

    async def get_item(self) -> GameItem:
        self.count += 1
        game, seed = self.config.game, self.rng.randrange(2**31)
        return GameItem(
            id=f"{game}-{self.config.seed}-{self.count}", prompt=f"{game}, seed {seed}", game=game, game_seed=seed
        )

    def reward(self, item: Item, messages: Messages) -> float:
        last = messages[-1] if messages else {}
        match = _RESULT.search(str(last.get("content", ""))) if last.get("role") == "user" else None
        if match is None:
            raise ValueError(
                "not a finished TextArena game: a seat's conversation ends on a user message saying "
                "'Your reward: R' (TextArena.play_game writes it from env.close())"
            )
        return float(match.group(1))

    async def play_game(self, item: GameItem, index: int) -> tuple[dict[str, Any], list[ScoredSequence]]:
        """One game to its end (or max_turns): its record for the group's extras, and a sequence
        per policy seat that moved."""
        config = self.config
        game, opponent = Game(config, item.game_seed), random.Random(item.game_seed)
        while not game.done and game.moves < config.max_turns:
            seat, observation = game.observe()
            if seat in config.opponent_seats:
                game.move(fixed_opponent_move(observation, config.opponent_move, opponent))
                continue
            heard = [{"role": "user", "content": game.text(observation)}]
            if seat in game.sessions:
                game.sessions[seat].add_messages(heard)
            else:
                game.sessions[seat] = self.chat(heard)
            await game.sessions[seat].sample(self.client, **self.sampling())
            game.move(game.sessions[seat].messages[-1]["content"])
        rewards, game_info = game.close()
        if game.done:
            scores = {seat: rewards.get(seat, 0.0) for seat in range(config.num_players)}
        else:  # stopped unfinished: a draw
            scores = dict.fromkeys(range(config.num_players), 0.0)
        sequences = []
        for seat, session in sorted(game.sessions.items()):
            session.messages.append(game.closing(seat, scores[seat], game_info))  # messages only, never tokens
            sequences.append(
                session.to_sequence(
                    scores[seat], extras={"seat": seat, "game": index, "turns": session.trajectory.turns}
                )
            )
        record = {
            "game": index,
            "finished": game.done,
            "moves": game.moves,
            "rewards": {str(seat): score for seat, score in scores.items()},
            "game_info": game_info,
            "seats_without_a_turn": [seat for seat in config.policy_seats if seat not in game.sessions],
        }
        return record, sequences

    async def collect_trajectories(self, item: GameItem) -> ScoredGroup:
        config = self.config
        games = math.ceil(config.group_size / len(config.policy_seats))
        # gather_sequences records a failed game as one error; each finished game is (record, sequences).
        played, errors = await self.gather_sequences([self.play_game(item, index) for index in range(games)])
        sequences = [sequence for _, game_sequences in played for sequence in game_sequences]
        extras = {
            "games": [record for record, _ in played],
            "policy_seats": config.policy_seats,
            "opponent_seats": config.opponent_seats,
        }
        return self.make_group(item, sequences[: config.group_size], errors=errors, extras=extras)

"""TextArena self-play through `clotho env serve` from .venv-env-textarena: two games through the
rollout flow into shards, every policy seat one sequence of its game's group scored with the game's
own reward, a fixed opponent kept out of the group, and the conformance suite by URL."""

from __future__ import annotations

import asyncio

import pytest

from core.scored_group import ScoredGroup
from environments.conformance import run_checks, trained_segments
from environments.loading import EnvironmentLoadError, load_config, load_environment_class
from tests.interop.conftest import rollout_groups, serve_adapter

ADAPTER = "environments.adapters.textarena:TextArena"
# Both finish with gibberish moves: TicTacToe ends at the first player's second invalid move (the
# second player never moves), SimpleNegotiation-v0-short after its 6 turns, both players moving.
GAMES = {
    "TicTacToe-v0": {"game": "TicTacToe-v0", "group_size": 4, "max_tokens": 8},
    "SimpleNegotiation-v0-short": {"game": "SimpleNegotiation-v0-short", "group_size": 2, "max_tokens": 8},
}


@pytest.fixture(scope="module")
def served_textarena():
    served = serve_adapter("textarena", ADAPTER)
    yield served
    served.stop()


def check_seats(group: ScoredGroup, tokenizer, policy_seats: list[int]) -> None:
    """Each game of the group gave one sequence per policy seat that moved, scored with that
    seat's reward as the game recorded it; its trained tokens decode to its moves, each of which the
    game echoed back to it."""
    games = group.extras["games"]
    assert group.extras["policy_seats"] == policy_seats
    assert len(group.sequences) == sum(len(policy_seats) - len(game["seats_without_a_turn"]) for game in games)
    for game in games:
        seats = [s.extras["seat"] for s in group.sequences if s.extras["game"] == game["game"]]
        assert seats == [seat for seat in policy_seats if seat not in game["seats_without_a_turn"]]
        assert game["finished"] and set(game["rewards"]) == {"0", "1"}
    for sequence in group.sequences:
        seat, game = sequence.extras["seat"], games[sequence.extras["game"]]
        assert sequence.score == game["rewards"][str(seat)]
        assert sequence.messages[-1]["role"] == "user" and sequence.messages[-1]["content"].endswith(
            f"Your reward: {sequence.score!r}"
        )
        moves = [m["content"] for m in sequence.messages if m["role"] == "assistant"]
        decoded = [
            tokenizer.decode(sequence.tokens[start:end], skip_special_tokens=True)
            for start, end in trained_segments(sequence)
        ]
        assert decoded == moves and len(moves) == sequence.extras["turns"] >= 1
        for turn, message in enumerate(sequence.messages):
            if message["role"] == "assistant":  # what the game heard is the move as sampled
                assert f"[Player {seat}] " in sequence.messages[turn + 1]["content"]
                assert message["content"].strip() in sequence.messages[turn + 1]["content"]


@pytest.mark.integration
@pytest.mark.parametrize("game", GAMES)
def test_self_play_runs_through_the_rollout_flow_one_sequence_per_policy_seat_with_the_games_rewards(
    game, served_textarena, prefect_server, policy_server, policy_tokenizer, tiny_tokenizer, tmp_path
) -> None:
    config = GAMES[game]
    summary, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_textarena.url,
        config,
        f"file://{tmp_path}/store/{game}",
        groups=2,
    )
    assert summary["totals"]["groups"] == 2 and len(groups) == 2
    for group in groups:
        assert group.env == "textarena" and group.extras["item"]["game"] == game
        assert len(group.extras["games"]) == config["group_size"] // 2  # two policy seats per game
        check_seats(group, tiny_tokenizer, policy_seats=[0, 1])
        for record in group.extras["games"]:
            assert sum(record["rewards"].values()) == 0.0  # both games are zero-sum (a draw is 0/0)
    if game == "SimpleNegotiation-v0-short":  # both players always move: every game gives two sequences
        assert all(
            len(group.sequences) == 2 and group.extras["games"][0]["seats_without_a_turn"] == [] for group in groups
        )
    else:  # the first player always moves
        assert all(
            0 in [s.extras["seat"] for s in group.sequences if s.extras["game"] == g]
            for group in groups
            for g in (0, 1)
        )


@pytest.mark.integration
def test_a_fixed_opponent_plays_legal_moves_and_stays_out_of_the_group(
    served_textarena, prefect_server, policy_server, policy_tokenizer, tiny_tokenizer, tmp_path
) -> None:
    config = {"game": "TicTacToe-v0", "opponent_seats": [0], "group_size": 2, "max_tokens": 8}
    _, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_textarena.url,
        config,
        f"file://{tmp_path}/store/opponent",
        groups=2,
    )
    assert len(groups) == 2
    for group in groups:
        assert [s.extras["seat"] for s in group.sequences] == [1, 1]  # two games, the policy's seat only
        check_seats(group, tiny_tokenizer, policy_seats=[1])
        for sequence in group.sequences:  # the opponent's first move was a legal one, picked from the listed moves
            assert "[GAME] Player 0 placed their symbol (O) in cell" in sequence.messages[0]["content"]


@pytest.mark.integration
@pytest.mark.parametrize("game", GAMES)
def test_the_served_adapter_passes_the_conformance_suite(
    game, served_textarena, policy_server, policy_tokenizer
) -> None:
    results = asyncio.run(
        run_checks(
            load_environment_class(served_textarena.url),
            {**GAMES[game], "group_size": 2},
            server_url=policy_server.base_url,
            tokenizer=policy_tokenizer,
            api_key=getattr(policy_server, "api_key", None),
        )
    )
    assert [(r.name, r.status, r.detail) for r in results if r.status != "passed"] == [
        ("gold answer scores top", "skipped", "skipped: no gold_completion")
    ]


@pytest.mark.integration
def test_the_service_fills_the_player_count_and_names_a_bad_table(served_textarena) -> None:
    env_class = load_environment_class(served_textarena.url)
    assert load_config(env_class, {"game": "ThreePlayerTicTacToe-v0", "group_size": 3}).model_dump()["num_players"] == 3
    for config, message in [
        ({"game": "TicTacToe-v9"}, "is not a TextArena game id"),
        ({"num_players": 3}, "TicTacToe-v0 does not take 3 players"),
        ({"opponent_seats": [2]}, "give distinct seats of 0..1"),
        ({"opponent_seats": [0, 1]}, "leave at least one to the policy"),
        ({"group_size": 3}, "use a multiple of 2"),
    ]:
        with pytest.raises(EnvironmentLoadError, match=message):
            load_config(env_class, config)


@pytest.mark.integration
def test_a_game_that_downloads_its_data_at_run_time_is_refused_once_at_config_naming_it(served_textarena) -> None:
    """Wordle-v0 fetches NLTK's word list when it is made; on a machine without the network (CI, most
    clusters) /config says so, with the fix, instead of a 500 from deep inside TextArena."""
    env_class = load_environment_class(served_textarena.url)
    try:
        load_config(env_class, {"game": "Wordle-v0", "group_size": 1})
    except EnvironmentLoadError as error:
        assert "downloads data at run time" in str(error) and "NLTK's 'words' data" in str(error), error
        assert "python -m nltk.downloader words" in str(error)
    else:
        pytest.skip("Wordle's word list is already on this machine: nothing to fetch")

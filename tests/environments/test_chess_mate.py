"""The chess mate-in-N environment: one position asked with each side to move, its mates checked by
python-chess move by move, the reward's cases, seeded determinism, and the conformance suite live."""

from __future__ import annotations

import asyncio
import random

import chess
import pytest
from pydantic import ValidationError

from core.scored_group import ScoredGroup
from environments.base import prompt_messages
from environments.bundled.chess_mate import SIDES, ChessMate, ChessMateConfig, checking_moves, prompt_text, turned
from environments.loading import EnvironmentLoadError, load_config
from environments.testing import EnvironmentConformance
from inference.client import PolicyClient


def environment(tokenizer, **config) -> ChessMate:
    env = ChessMate(config, client=None, tokenizer=str(tokenizer))
    asyncio.run(env.setup())
    return env


def items(env: ChessMate, count: int):
    return [asyncio.run(env.get_item()) for _ in range(count)]


def mates(board: chess.Board, move: chess.Move) -> bool:
    board.push(move)
    try:
        return board.is_checkmate()
    finally:
        board.pop()


def forces_mate(board: chess.Board, move: chess.Move, n: int) -> bool:
    """Every legal move at every level, nothing pruned: the slow search to check the fast one by."""
    board.push(move)
    try:
        if board.is_checkmate():
            return True
        replies = list(board.legal_moves)
        if n == 1 or not replies:
            return False
        for reply in replies:
            board.push(reply)
            follows = any(forces_mate(board, again, n - 1) for again in list(board.legal_moves))
            board.pop()
            if not follows:
                return False
        return True
    finally:
        board.pop()


def test_an_item_is_one_position_that_both_sides_mate_from(tiny_model_dir) -> None:
    env = environment(tiny_model_dir, seed=0)
    found = items(env, 3)
    assert len({item.id for item in found}) == 3
    for item in found:
        white, black = chess.Board(item.fens["white"]), chess.Board(item.fens["black"])
        assert white.board_fen() == black.board_fen() and white.castling_rights == black.castling_rights
        assert (white.turn, black.turn) == (chess.WHITE, chess.BLACK)
        assert white.is_valid() and black.is_valid()  # neither side stands in check when the other moves
        for side, board in (("white", white), ("black", black)):
            mating = {move.uci() for move in board.legal_moves if mates(board, move)}
            assert mating and set(item.answer[side]) == mating, (item.fens[side], item.answer[side])
        assert item.prompt == [{"role": "user", "content": prompt_text(item.fens["white"], 1)}]
        assert "Side to move: white" in item.prompt[0]["content"] and "ANSWER: <move>" in item.prompt[0]["content"]
    assert "Side to move: black" in prompt_text(found[0].fens["black"], 1)


def test_mate_in_two_has_no_mate_in_one_and_every_first_move_a_full_search_finds(tiny_model_dir) -> None:
    [item] = items(environment(tiny_model_dir, seed=3, n=2), 1)  # a seed whose position is found fast
    assert item.n == 2 and "forces checkmate in 2 moves" in item.prompt[0]["content"]
    for side in SIDES:
        board = chess.Board(item.fens[side])
        assert not any(mates(board, move) for move in board.legal_moves)
        full = {move.uci() for move in list(board.legal_moves) if forces_mate(board, move, 2)}
        assert full and set(item.answer[side]) == full


def test_checking_moves_are_exactly_the_moves_that_give_check() -> None:
    rng = random.Random(0)
    tried = 0
    for _ in range(20):
        board = chess.Board()
        while not board.is_game_over() and board.ply() < 200:
            board.push(rng.choice(list(board.legal_moves)))
            for position in (board, turned(board)):  # turned: the side that just moved, to move again
                if position is not None and not position.is_check():
                    fast = checking_moves(position)
                    assert len(fast) == len(set(fast))
                    assert set(fast) == {move for move in position.legal_moves if position.gives_check(move)}, (
                        position.fen()
                    )
                    tried += 1
    assert tried > 1000


def test_reward_mate_one_legal_small_illegal_and_garbage_zero(tiny_model_dir) -> None:
    env = environment(tiny_model_dir, seed=2)
    [item] = items(env, 1)
    white = chess.Board(item.fens["white"])

    def score(side: str, answer: str) -> float:
        prompt = [{"role": "user", "content": prompt_text(item.fens[side], item.n)}]
        return env.reward(item, prompt + [{"role": "assistant", "content": answer}])

    mate = chess.Move.from_uci(item.answer["white"][0])
    quiet = next(move for move in white.legal_moves if move.uci() not in item.answer["white"])
    pairs = ((a, b) for a in chess.SQUARES for b in chess.SQUARES if a != b)
    illegal = next(move for move in (chess.Move(a, b) for a, b in pairs) if move not in white.legal_moves)
    assert score("white", f"ANSWER: {mate.uci()}") == 1.0
    assert score("white", f"Mate is on the board.\nANSWER: {white.san(mate)}") == 1.0
    assert score("white", f"ANSWER: {quiet.uci()}") == score("white", f"ANSWER: {white.san(quiet)}") == 0.1
    assert score("white", f"ANSWER: {quiet.uci()}\nno, better:\nANSWER: {mate.uci()}") == 1.0  # the last answer counts
    assert score("white", f"ANSWER: {illegal.uci()}") == 0.0
    for garbage in (
        "",
        "no idea",
        "-99999",
        mate.uci(),
        "ANSWER: banana",
        "ANSWER: 0000",
        "ANSWER: --",
        "ANSWER: z9z9",
    ):
        assert score("white", garbage) == 0.0, garbage
    # The black-to-move prompt is scored on black's board: white's mate moves a white piece there.
    assert score("black", f"ANSWER: {item.answer['black'][0]}") == 1.0
    assert score("black", f"ANSWER: {mate.uci()}") == 0.0
    assert (
        env.reward(item, prompt_messages(item) + [{"role": "assistant", "content": env.gold_completion(item)}]) == 1.0
    )
    with pytest.raises(ValueError, match="no FEN of this item"):
        env.reward(
            item,
            [
                {"role": "user", "content": prompt_text(chess.STARTING_FEN, 1)},
                {"role": "assistant", "content": "ANSWER: e2e4"},
            ],
        )


def test_items_are_determined_by_the_seed(tiny_model_dir) -> None:
    first, again, other = (items(environment(tiny_model_dir, seed=seed), 2) for seed in (5, 5, 6))
    assert [item.model_dump() for item in first] == [item.model_dump() for item in again]
    assert [item.fens for item in first] != [item.fens for item in other]


def test_group_size_is_twice_samples_per_side() -> None:
    assert ChessMateConfig().group_size == 4
    assert ChessMateConfig(samples_per_side=3).group_size == 6
    assert ChessMateConfig(group_size=6).samples_per_side == 3
    assert ChessMateConfig(group_size=2, samples_per_side=1).group_size == 2
    with pytest.raises(ValidationError, match="group_size 5 is odd"):
        ChessMateConfig(group_size=5)
    with pytest.raises(EnvironmentLoadError, match=r"group_size 4 != 2 \* samples_per_side 3"):
        load_config(ChessMate, {"group_size": 4, "samples_per_side": 3})


@pytest.mark.integration
async def test_a_group_holds_both_sides_each_sampled_from_its_own_prompt(policy_server, policy_tokenizer) -> None:
    async with PolicyClient(policy_server.base_url, api_key=getattr(policy_server, "api_key", None)) as client:
        env = ChessMate({"samples_per_side": 2, "max_tokens": 4, "seed": 1}, client=client, tokenizer=policy_tokenizer)
        await env.setup()
        item = await env.get_item()
        group = await env.sample_group(item)
    assert isinstance(group, ScoredGroup), group
    assert [sequence.extras["side"] for sequence in group.sequences] == ["white", "white", "black", "black"]
    prompts = []
    for sequence in group.sequences:
        side = sequence.extras["side"]
        assert sequence.messages[0]["content"] == prompt_text(item.fens[side], 1)
        assert sequence.score == env.reward(item, sequence.messages)
        prompts.append(tuple(sequence.tokens[: sequence.mask.index(True)]))
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]  # one rendered prompt per side


@pytest.mark.integration
class TestChessMateConformance(EnvironmentConformance):
    environment_class = ChessMate
    config = {"samples_per_side": 1, "max_tokens": 8}

"""Chess mate-in-N: one position from seeded random playouts, asked with white and with black to move.

Each item is a position where BOTH sides, when it is their turn, force checkmate in exactly `n` moves
(mate in 1 by default), verified by search. A group is two related problems, not repeated samples:
`samples_per_side` answers to the white-to-move prompt, then as many to the same pieces with black to
move (sequence extras["side"] says which). The prompt gives the FEN, a board diagram and the side to
move; the answer is one move, in UCI or SAN, on a line of its own:

    ANSWER: h5f7        (or ANSWER: Qxf7#)

Reward: 1.0 for a move that forces the mate, 0.1 for another legal move, 0.0 for an illegal,
missing or unreadable one.
"""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import chess
from pydantic import Field, model_validator

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import Environment, EnvironmentConfig, Item, final_answer

SIDES = ("white", "black")
LEGAL_REWARD = 0.1
MAX_PLIES = 200  # a playout this long has mostly bare kings left: start another
_ANSWER = re.compile(r"ANSWER:\s*([A-Za-z0-9=+#-]+)")
_FEN = re.compile(r"^FEN: (.+)$", re.MULTILINE)
_CHECKERS = (chess.PAWN, chess.KNIGHT, chess.BISHOP, chess.ROOK, chess.QUEEN)


class ChessMateConfig(EnvironmentConfig):
    n: int = Field(default=1, ge=1, le=2, description="Moves to mate in: 1, or 2 (a deeper search, far slower items).")
    samples_per_side: int = Field(default=2, ge=1, description="Samples per side to move; group_size is twice this.")

    @model_validator(mode="after")
    def _both_sides_fill_the_group(self) -> ChessMateConfig:
        given = self.model_fields_set
        if "group_size" in given and "samples_per_side" not in given:
            if self.group_size % 2:
                raise ValueError(
                    f"group_size {self.group_size} is odd; a group holds as many samples of each side to "
                    "move: give an even group_size (or samples_per_side)"
                )
            self.samples_per_side = self.group_size // 2
        elif self.group_size != 2 * self.samples_per_side:
            if "group_size" in given:
                raise ValueError(
                    f"group_size {self.group_size} != 2 * samples_per_side {self.samples_per_side}; "
                    "set one of them, the other follows"
                )
            self.group_size = 2 * self.samples_per_side
        return self


class ChessMateItem(Item):
    fens: dict[str, str] = Field(description="The position with each side to move, by side.")
    n: int = Field(description="Moves to mate in.")


def checking_moves(board: chess.Board) -> list[chess.Move]:
    """The legal moves of the side to move that give check, without trying every move: a piece gives
    check from where the same piece on the enemy king's square would attack it; moves that may
    uncover a check (a piece in line with the king, a king, a promotion, en passant) are tried."""
    mover, king = board.turn, board.king(not board.turn)
    probe = board.copy(stack=False)
    probe.set_piece_at(king, chess.Piece(chess.QUEEN, not mover))
    uncovering = board.kings | (board.pawns & (chess.BB_RANK_7 if mover else chess.BB_RANK_2))
    for square in chess.scan_forward(probe.attacks_mask(king) & board.occupied_co[mover]):
        if board.attackers_mask(mover, king, board.occupied & ~chess.BB_SQUARES[square]):
            uncovering |= chess.BB_SQUARES[square]
    uncovering &= board.occupied_co[mover]
    checked_from = {}
    for piece_type in _CHECKERS:
        probe.set_piece_at(king, chess.Piece(piece_type, not mover))
        checked_from[piece_type] = probe.attacks_mask(king)
    reach = checked_from[chess.QUEEN] | checked_from[chess.KNIGHT] | checked_from[chess.PAWN]
    direct = [
        move
        for move in board.generate_legal_moves(board.occupied_co[mover] & ~uncovering, reach)
        if checked_from[board.piece_type_at(move.from_square)] & chess.BB_SQUARES[move.to_square]
        and not board.is_en_passant(move)
    ]
    tried = list(board.generate_legal_moves(uncovering))
    tried += [move for move in board.generate_legal_ep() if move not in tried]
    return direct + [move for move in tried if board.gives_check(move)]


def wins(board: chess.Board, move: chess.Move, n: int) -> bool:
    """Whether `move` forces checkmate within n moves of its side (stalemate is no win)."""
    board.push(move)
    try:
        if n == 1:
            return board.is_checkmate()
        replies = list(board.legal_moves)
        if not replies:
            return board.is_check()
        return all(mate_follows(board, reply, n - 1) for reply in replies)
    finally:
        board.pop()


def mate_follows(board: chess.Board, reply: chess.Move, n: int) -> bool:
    """Whether after `reply` the other side still forces checkmate within n moves."""
    board.push(reply)
    try:
        return any(wins(board, move, n) for move in first_moves(board, checks_only=n == 1))
    finally:
        board.pop()


def winning_moves(board: chess.Board, n: int, checks_only: bool = False) -> list[chess.Move]:
    """The moves that force mate in n when no shorter mate exists; [] otherwise (a mate-in-2 problem
    with a mate in 1 in it is a mate-in-1 problem). checks_only: try checking first moves only, a
    quicker test that a mate exists (a mate in 1 is always a check)."""
    if n > 1 and winning_moves(board, n - 1):
        return []
    return [move for move in first_moves(board, checks_only=n == 1 or checks_only) if wins(board, move, n)]


def first_moves(board: chess.Board, checks_only: bool) -> list[chess.Move]:
    return checking_moves(board) if checks_only else list(board.legal_moves)


def turned(board: chess.Board) -> chess.Board | None:
    """The same pieces with the other side to move, or None when that is no legal position (the
    side that moved last would stand in check)."""
    other = board.copy(stack=False)
    other.turn = not board.turn
    return other if other.is_valid() else None


def both_sides_mate(board: chess.Board, n: int) -> chess.Board | None:
    """The position without its move history (no en passant square), if both sides mate in n from it."""
    if board.is_check():  # then the side that moved last cannot be the one to move
        return None
    bare = board.copy(stack=False)
    bare.ep_square = None
    other = turned(bare)  # the rarer mate first: most positions fail there
    if other is None or not winning_moves(other, n, checks_only=True):
        return None
    return bare if winning_moves(bare, n, checks_only=True) else None


def playout_position(rng: random.Random, n: int) -> chess.Board:
    """Random playouts until a position where both sides, each to move, mate in n.

    Queens are never captured while another move exists: mates for both sides need exposed kings
    and strong pieces, and random play trades the queens off long before the kings are exposed.
    When the side to move has a mate, the last mover's other moves are tried too: most keep that
    mate, and one may set up a mate of its own."""
    while True:
        board = chess.Board()
        while board.ply() < MAX_PLIES:
            moves = list(board.generate_legal_moves(chess.BB_ALL, ~board.queens)) or list(board.legal_moves)
            if not moves:
                break
            board.push(rng.choice(moves))
            if board.is_check() or not winning_moves(board, n, checks_only=True):
                continue
            last = board.pop()
            for move in [last] + [m for m in board.legal_moves if m != last]:
                board.push(move)
                found = both_sides_mate(board, n)
                if found is not None:
                    return found
                board.pop()
            board.push(last)


def prompt_text(fen: str, n: int) -> str:
    board = chess.Board(fen)
    side = SIDES[board.turn == chess.BLACK]
    ranks = [f"{8 - index} {row}" for index, row in enumerate(str(board).splitlines())]
    goal = "checkmates in one move" if n == 1 else f"forces checkmate in {n} moves"
    return (
        f"Chess puzzle: find the move that {goal}.\nFEN: {fen}\nSide to move: {side}\n"
        "Board (white uppercase, black lowercase):\n" + "\n".join(ranks) + "\n  a b c d e f g h\n"
        "Answer with one move in UCI (like e2e4) or SAN (like Nf3) on its own line: ANSWER: <move>"
    )


def parse_move(board: chess.Board, text: str) -> chess.Move | None:
    """The legal move `text` names in UCI or SAN, or None (a null move '0000' or '--' is no move)."""
    for parse in (board.parse_uci, board.parse_san):
        try:
            move = parse(text)
        except ValueError:
            continue
        if move in board.legal_moves:
            return move
    return None


class ChessMate(Environment):
    """Items are positions both sides mate in n from; each group asks both sides' problems."""

    name = "chess_mate"
    config_class = ChessMateConfig
    item_class = ChessMateItem

    async def new_item(self, rng: random.Random, index: int) -> dict[str, Any]:
        n = self.config.n
        # Off the event loop: a mate-in-2 search takes seconds, and the flow's groups keep sampling meanwhile.
        found = await asyncio.to_thread(playout_position, rng, n)
        boards = {side: found if found.turn == (side == "white") else turned(found) for side in SIDES}
        return dict(
            n=n,
            fens={side: board.fen() for side, board in boards.items()},
            prompt=[{"role": "user", "content": prompt_text(boards["white"].fen(), n)}],
            answer={side: [move.uci() for move in winning_moves(board, n)] for side, board in boards.items()},
        )

    def side_of(self, item: ChessMateItem, messages: list[dict]) -> str:
        """Which of the item's problems the conversation asks: the FEN in its first user message."""
        prompt = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
        fen = _FEN.search(prompt)
        for side in SIDES:
            if fen and fen.group(1).strip() == item.fens[side]:
                return side
        raise ValueError(
            f"item {item.id}: the first user message holds no FEN of this item; score a conversation "
            "with the item it was sampled from"
        )

    def reward(self, item: ChessMateItem, messages: list[dict]) -> float:
        side = self.side_of(item, messages)
        answers = _ANSWER.findall(final_answer(messages))
        move = parse_move(chess.Board(item.fens[side]), answers[-1]) if answers else None
        if move is None:
            return 0.0
        return 1.0 if move.uci() in item.answer[side] else LEGAL_REWARD

    def gold_completion(self, item: ChessMateItem) -> str:
        return f"ANSWER: {item.answer['white'][0]}"

    async def side_sequences(self, item: ChessMateItem, side: str, samples: int) -> list[ScoredSequence]:
        prompt = [{"role": "user", "content": prompt_text(item.fens[side], item.n)}]
        asked = item.model_copy(update={"prompt": prompt})  # scored_completion reads the prompt from the item
        prompt_ids, completions = await self.sample_chat(asked.prompt, n=samples)
        sequences = [self.scored_completion(asked, prompt_ids, completion) for completion in completions]
        for sequence in sequences:
            sequence.extras["side"] = side
        return sequences

    async def collect_trajectories(self, item: ChessMateItem) -> ScoredGroup:
        # evaluate's twin asks for one greedy answer (group_size 1): the item's own, white-to-move prompt
        sides = SIDES if self.config.group_size >= 2 else SIDES[:1]
        samples = min(self.config.samples_per_side, self.config.group_size // len(sides))
        per_side = await asyncio.gather(*(self.side_sequences(item, side, samples) for side in sides))
        return self.make_group(item, [sequence for sequences in per_side for sequence in sequences])

"""Multi-turn tool use: price a shopping list with a lookup table and a calculator, then answer.

The call format, one call per assistant turn (the first `CALL` line of the turn is run):

    CALL lookup(apple)          -> the unit price of an item from the shop's table
    CALL calc(3 * 4 + 2 * 5)    -> the value of + - * / ( ) over numbers
    ANSWER: 22                  -> the final answer; the conversation ends

Each tool output comes back as a `tool` message: masked out of training (ChatSession), and a
malformed or unknown call gets an error message the model can read and correct, never an
exception. Reward, on the final answer only: 1.0 for the right total, 0.0 otherwise.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from pydantic import Field

from environments.base import Environment, EnvironmentConfig, Item, final_answer, prompt_messages
from environments.chat import ChatSession

PRICES = {"apple": 3, "pear": 5, "bread": 4, "milk": 2, "cheese": 7, "egg": 1, "rice": 6, "tea": 8}
_CALL = re.compile(r"CALL\s+(\w+)\s*\((.*)\)\s*$", re.MULTILINE)
_ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
TOOLS = "lookup(item), calc(expression)"


class ToolUseConfig(EnvironmentConfig):
    items_per_list: int = Field(default=2, ge=1, le=4, description="Distinct items on a shopping list.")
    max_quantity: int = Field(default=4, ge=1, description="Each item is bought 1..max_quantity times.")
    turns: int = Field(default=4, ge=1, description="Assistant turns per rollout (calls and the answer).")


def calculate(expression: str) -> float:
    """+ - * / and parentheses over numbers; ValueError for anything else (no names, no calls)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"calc takes numbers and + - * / ( ), not {ast.unparse(node)!r}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"calc could not parse {expression!r}") from None
    try:
        return value(tree.body)
    except ZeroDivisionError:
        raise ValueError("calc: division by zero") from None


def run_tool(text: str) -> str | None:
    """The tool message answering an assistant turn, or None when the turn makes no call."""
    match = _CALL.search(text)
    if match is None:
        if "CALL" in text:
            return f"Tool error: write a call as CALL tool(argument) on its own line; tools: {TOOLS}."
        return None
    tool, argument = match.group(1), match.group(2).strip()
    if tool == "lookup":
        price = PRICES.get(argument.lower().strip("'\" "))
        return (
            f"{argument}: {price}"
            if price is not None
            else f"Tool error: no item {argument!r}; items: {', '.join(PRICES)}."
        )
    if tool == "calc":
        try:
            result = calculate(argument)
        except ValueError as error:
            return f"Tool error: {error}."
        return f"{result:g}"
    return f"Tool error: unknown tool {tool!r}; tools: {TOOLS}."


class ToolUse(Environment):
    """Each rollout is one conversation of up to `turns` assistant turns: tool calls, each answered
    by a masked tool message, until the model answers or runs out of turns."""

    name = "tool_use"
    config_class = ToolUseConfig

    def new_item(self, rng: random.Random, index: int) -> Item:
        names = rng.sample(sorted(PRICES), self.config.items_per_list)
        basket = {name: rng.randint(1, self.config.max_quantity) for name in names}
        listing = ", ".join(f"{quantity} {name}" for name, quantity in basket.items())
        prompt = (
            f"What do {listing} cost in total? Tools, one call per turn: CALL lookup(item) gives a unit "
            "price, CALL calc(expression) computes. End with ANSWER: <number>."
        )
        return Item(
            id=f"{self.config.seed}-{index + 1}",
            prompt=[{"role": "user", "content": prompt}],
            answer=sum(PRICES[name] * quantity for name, quantity in basket.items()),
            extras={"basket": basket},
        )

    def reward(self, item: Item, messages: list[dict]) -> float:
        match = _ANSWER.search(final_answer(messages))
        return float(match is not None and float(match.group(1)) == item.answer)

    def gold_completion(self, item: Item) -> str:
        return f"ANSWER: {item.answer}"

    async def play(self, item: Item) -> ChatSession:
        session = self.chat(prompt_messages(item))
        for turn in range(self.config.turns):
            await session.sample(self.client, **self.sampling())
            text = session.messages[-1]["content"]
            output = None if _ANSWER.search(text) else run_tool(text)
            # An answer, a turn that neither calls nor answers, or the last turn: it ends on the model's words.
            if output is None or turn == self.config.turns - 1:
                break
            session.add_messages([{"role": "tool", "content": output}])
        return session

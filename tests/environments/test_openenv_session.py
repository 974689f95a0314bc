"""The OpenEnv adapter's parse from an action's JSON schema and its session capacity, without
OpenEnv (environments/adapters/openenv_session.py)."""

from __future__ import annotations

import asyncio

from environments.adapters.openenv_session import Capacity, SchemaAction, server_error

MOVE = {  # grid_world's kind: an enum field (as $ref), with OpenEnv's metadata
    "properties": {"metadata": {"type": "object"}, "action": {"$ref": "#/$defs/MoveAction"}},
    "required": ["action"],
    "$defs": {"MoveAction": {"enum": ["UP", "DOWN", "LEFT", "RIGHT"], "type": "string"}},
}
STEP = {
    "properties": {"direction": {"type": "string", "enum": ["up", "down"]}, "steps": {"type": "integer"}},
    "required": ["direction"],
}
MESSAGE = {"properties": {"metadata": {"type": "object"}, "message": {"type": "string"}}, "required": ["message"]}
TOOL = {
    "properties": {"type": {"const": "call_tool"}, "tool_name": {"type": "string"}, "arguments": {"type": "object"}}
}


def test_an_action_s_schema_decides_how_text_becomes_it() -> None:
    message = SchemaAction(MESSAGE)  # the echo environment's: one string field takes the whole text
    assert message("hello {there}") == {"message": "hello {there}"} and message.instructions() is None
    move = SchemaAction(MOVE)
    assert move('I go {"action": "UP"} now') == {"action": "UP"} and move("I choose RIGHT.") == {"action": "RIGHT"}
    assert "metadata" not in move.instructions() and '"required": ["action"]' in move.instructions()
    step = SchemaAction(STEP)
    assert step('```json\n{"direction": "up", "steps": 2, "other": 1}\n```') == {"direction": "up", "steps": 2}
    assert step("no json here") == {}  # nothing to read: validation refuses it, the episode ends there
    tool = SchemaAction(TOOL)  # constants are filled in, not asked for
    assert tool('{"tool_name": "echo", "arguments": {"x": 1}}') == {
        "tool_name": "echo",
        "arguments": {"x": 1},
        "type": "call_tool",
    }


def test_a_server_s_errors_are_read_with_their_code() -> None:
    refused = RuntimeError("Server error: Server at capacity: 1/1 sessions active (code: CAPACITY_REACHED)")
    assert server_error(refused) == ("CAPACITY_REACHED", "Server at capacity: 1/1 sessions active")
    assert (
        server_error(RuntimeError("something else")) is None
        and server_error(ValueError("Server error: x (code: Y)")) is None
    )


def test_a_refusal_for_capacity_sets_the_limit_and_episodes_wait_for_a_slot() -> None:
    async def scenario() -> list[int]:
        capacity, seen = Capacity(None), []

        async def episode() -> None:
            async with capacity.slot():
                seen.append(capacity.active)
                await asyncio.sleep(0.01)

        async with capacity.slot():
            capacity.refused("Server at capacity: 1/2 sessions active")
        await asyncio.gather(*(episode() for _ in range(6)))
        return seen

    assert max(asyncio.run(scenario())) == 2

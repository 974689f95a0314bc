"""What the OpenEnv adapter needs of an OpenEnv server beyond its client, with no OpenEnv import
(unit-testable anywhere): the default text-to-action parse from the action's JSON schema, the
errors a server answers with, and its session capacity."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any


class SchemaAction:
    """The default parse where the action's JSON schema is known: its fields (`metadata` and
    constants left out, constants filled in). One string field takes the whole text; otherwise
    the first JSON object in the text gives the fields it names, and with one field a bare value
    is taken too ("UP", "3": pydantic converts it as the field's type)."""

    def __init__(self, schema: dict[str, Any]):
        properties = dict(schema.get("properties") or {})
        properties.pop("metadata", None)
        self.constants = {name: spec["const"] for name, spec in properties.items() if "const" in spec}
        self.fields = [name for name in properties if name not in self.constants]
        self.schema = {**schema, "properties": {name: properties[name] for name in self.fields}}
        self.schema["required"] = [name for name in schema.get("required", []) if name in self.fields]
        only = properties[self.fields[0]] if len(self.fields) == 1 else None
        self.whole_text = only is not None and only.get("type") == "string" and "enum" not in only  # free text

    def instructions(self) -> str | None:
        """The system message that asks for the action's form (none for a whole-text action)."""
        if self.whole_text:
            return None
        return "Reply with one JSON object for your action, matching this JSON schema: " + json.dumps(
            self.schema, sort_keys=True
        )

    def __call__(self, text: str) -> dict[str, Any]:
        if self.whole_text:
            return {self.fields[0]: text, **self.constants}
        decoder = json.JSONDecoder()
        for start in (index for index, character in enumerate(text) if character == "{"):
            try:
                found, _ = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                continue
            if isinstance(found, dict) and set(found) & set(self.fields):
                return {**{k: v for k, v in found.items() if k in self.fields}, **self.constants}
        if len(self.fields) == 1:  # a bare value: the reply's last word
            words = text.replace("`", " ").split()
            return {self.fields[0]: words[-1].strip(".,;:!\"'") if words else "", **self.constants}
        return dict(self.constants)  # nothing to read: the action fails validation, the episode ends there


def server_error(error: BaseException) -> tuple[str, str] | None:
    """(code, message) of an error an OpenEnv server answered with (GenericEnvClient raises them as
    RuntimeError('Server error: MESSAGE (code: CODE)')); None for any other error."""
    match = re.fullmatch(r"Server error: (.*) \(code: ([A-Z_]+)\)", str(error), flags=re.DOTALL)
    return (match.group(2), match.group(1)) if isinstance(error, RuntimeError) and match else None


class Capacity:
    """Episodes open at once, within a limit learned from the server: at first `limit` (None: no
    limit), lowered to the server's own when it refuses a session for capacity (CAPACITY_REACHED
    names it: 'N/M sessions active'); a refused episode waits for a slot and tries again."""

    def __init__(self, limit: int | None):
        self.limit, self.active = limit, 0
        self.changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def slot(self):
        async with self.changed:
            await self.changed.wait_for(lambda: self.limit is None or self.active < self.limit)
            self.active += 1
        try:
            yield
        finally:
            async with self.changed:
                self.active -= 1
                self.changed.notify_all()

    def refused(self, message: str) -> None:
        found = re.search(r"(\d+)/(\d+) sessions", message)
        most = int(found.group(2)) if found else max(1, self.active - 1)
        self.limit = min(self.limit or most, most)

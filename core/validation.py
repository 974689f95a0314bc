"""How a pydantic validation error reads: one line that names each field and what is wrong with it,
shared by every command and config loader."""

from __future__ import annotations

from typing import Any


def describe_validation_error(error: Any, model: Any = None) -> str:
    """A pydantic ValidationError as one line: 'field.path: what (got VALUE); ...', plus the valid
    fields where a name is unknown (`model`: the validated class, to list them)."""
    problems = []
    for problem in error.errors():
        where = ".".join(map(str, problem["loc"])) or "(top level)"
        message = problem["msg"].removeprefix("Value error, ")
        value = problem.get("input")
        if problem["type"] == "extra_forbidden":
            known = _fields_at(model, problem["loc"][:-1])
            message = "unknown field; check the spelling" + (f" (fields: {', '.join(known)})" if known else "")
        elif isinstance(value, (int, float, str, bool)) and len(repr(value)) <= 60 and repr(value) not in message:
            message += f" (got {value!r})"
        problems.append(f"{where}: {message}")
    return " ".join("; ".join(problems).split())


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """The field names of the pydantic model at `loc` inside `model` (lists and optionals followed)."""
    from pydantic import BaseModel

    def model_of(annotation: Any) -> Any:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation
        for argument in getattr(annotation, "__args__", ()):
            if (found := model_of(argument)) is not None:
                return found
        return None

    for part in loc:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = model_of(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []

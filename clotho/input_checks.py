"""Checks of command-line input shared by clotho's commands: each bad value is one
typer.BadParameter naming the option and the fix; a pydantic error as one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


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


def check_server_url(url: str, option: str = "--server") -> str:
    """An http(s) URL with a host, or typer.BadParameter naming the option and what one looks like."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except Exception:
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise typer.BadParameter(f"{url!r} is not an http(s) URL; give the server's base URL, e.g. http://127.0.0.1:8000",
                                 param_hint=option)  # fmt: skip
    return url


def check_tokenizer(tokenizer: str, option: str = "--tokenizer") -> str:
    """A tokenizer directory holding tokenizer files, or what could be a hub id: checked on disk
    only (loading it would cost seconds the flow spends anyway)."""
    from trainer.config import is_hub_id

    fix = "give the policy model's directory or Hugging Face id (by default, the model the server serves)"
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise typer.BadParameter(f"{tokenizer!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); {fix}",
                                     param_hint=option)  # fmt: skip
    elif path.exists() or not is_hub_id(tokenizer):
        raise typer.BadParameter(f"{tokenizer!r} {'is a file' if path.exists() else 'does not exist'}; {fix}", param_hint=option)
    return tokenizer


# Any of these makes a directory a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_model(model: str, option: str = "--model") -> str:
    from trainer.config import check_model_source

    try:
        return check_model_source(model)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint=option) from None

"""Checks of command-line input shared by clotho's commands: each bad value is one
typer.BadParameter naming the option and the fix (a pydantic error reads as core.validation says)."""

from __future__ import annotations

from pathlib import Path

import typer


def check_server_url(url: str, option: str = "--server") -> str:
    """An http(s) URL with a host, or typer.BadParameter naming the option and what one looks like."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except Exception:  # noqa: BLE001 - httpx raises several kinds for a malformed URL; all mean "not a URL"
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise typer.BadParameter(
            f"{url!r} is not an http(s) URL; give the server's base URL, e.g. http://127.0.0.1:8000", param_hint=option
        )
    return url


def check_tokenizer(tokenizer: str, option: str = "--tokenizer") -> str:
    """A tokenizer directory holding tokenizer files, or what could be a hub id: checked on disk
    only (loading it would cost seconds the flow spends anyway)."""
    from storage.models import check_model_url, is_model_url
    from trainer.config import is_hub_id

    fix = "give the policy model's directory or Hugging Face id (by default, the model the server serves)"
    if is_model_url(tokenizer):
        try:
            return check_model_url(tokenizer)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint=option) from None
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise typer.BadParameter(
                f"{tokenizer!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); {fix}", param_hint=option
            )
    elif path.exists() or not is_hub_id(tokenizer):
        raise typer.BadParameter(
            f"{tokenizer!r} {'is a file' if path.exists() else 'does not exist'}; {fix}", param_hint=option
        )
    return tokenizer


# Any of these makes a directory a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_model(model: str, option: str = "--model") -> str:
    from trainer.config import check_model_source

    try:
        return check_model_source(model)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint=option) from None

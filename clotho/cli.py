"""The `clotho` command line: one entry point over every stage of the data flow."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import typer

app = typer.Typer(help="clotho: RL for language models through environments.", no_args_is_help=True)
model_app = typer.Typer(help="Build or inspect policy models.", no_args_is_help=True)
app.add_typer(model_app, name="model")

try:  # storage ships the shard commands; mounted here so `clotho shards ...` works
    from storage.cli import shards_app

    app.add_typer(shards_app, name="shards")
except ImportError:  # pragma: no cover - storage not installed in a minimal environment
    pass


@model_app.command("tiny")
def model_tiny(
    out_dir: Path = typer.Argument(..., help="Directory to write the model and tokenizer to."),
    tie_embeddings: bool = typer.Option(False, "--tie-embeddings/--no-tie-embeddings", help="Share input and output embeddings."),
    seed: int = typer.Option(0, help="Seed for the tokenizer corpus and the weights (deterministic)."),
) -> None:
    """Build a tiny Qwen2 model (2 layers, hidden 128) and a byte-level BPE tokenizer, offline."""
    from inference.tiny_model import build_tiny_model

    started = time.monotonic()
    out = build_tiny_model(out_dir, seed=seed, tie_embeddings=tie_embeddings)
    typer.echo(f"tiny model written to {out} in {time.monotonic() - started:.1f}s")


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


@app.command()
def serve(
    model: str = typer.Option(..., help="Local model directory or Hugging Face model id."),
    port: int = typer.Option(8000, help="Port of the OpenAI-compatible API."),
    host: str = typer.Option("127.0.0.1", help="Bind address; anything but loopback needs --api-key."),
    api_key: str = typer.Option(None, envvar="CLOTHO_API_KEY", help="API key the server requires."),
    served_model_name: str = typer.Option("policy", help="Model name clients ask for."),
    log_file: Path = typer.Option(None, help="Server log (default .clotho/logs/vllm-PORT.log)."),
    dtype: str = typer.Option("float32", help="Weights dtype: float32 on CPU, bfloat16 on GPUs."),
    max_model_len: int = typer.Option(2048, help="Longest sequence the server accepts."),
    startup_timeout: float = typer.Option(600.0, help="Seconds to wait for /health."),
) -> None:
    """Start the vLLM policy server, wait until healthy, and keep it up until Ctrl-C."""
    from inference.server import PolicyServer, ServerStartError

    try:
        server = PolicyServer(
            model, host=host, port=port, api_key=api_key, served_model_name=served_model_name,
            log_path=log_file, dtype=dtype, max_model_len=max_model_len,
        )  # fmt: skip
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    typer.echo(f"starting vLLM ({server.python}) for {model}; log: {server.log_path}")
    # SIGTERM behaves like Ctrl-C so a supervisor's stop also takes the workers down.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.start(timeout=startup_timeout)
        typer.echo(f"policy server ready at {server.base_url}/v1 (model name '{served_model_name}'); Ctrl-C stops it")
        while server.process is not None and server.process.poll() is None:
            time.sleep(1)
        typer.echo(f"vLLM exited on its own; see {server.log_path}", err=True)
        raise typer.Exit(1)
    except ServerStartError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo("stopping policy server")
    finally:
        server.stop()


@app.command()
def demo(
    workdir: Path = typer.Option(Path(".clotho/demo"), help="Where the model, logs and outputs go."),
    groups: int = typer.Option(6, help="Groups to collect per environment."),
) -> None:
    """Run clotho's pipeline on the embedded defaults and print a summary of what ran."""
    from clotho.demo import run_demo

    run_demo(workdir, groups_per_env=groups)


if __name__ == "__main__":
    app()

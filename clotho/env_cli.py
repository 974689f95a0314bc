"""`clotho env new | list | check | serve`: scaffold an environment package, list what is installed,
run the conformance suite against a policy server, and serve an environment over HTTP."""

from __future__ import annotations

import re
from pathlib import Path

import typer

env_app = typer.Typer(help="Write, find and check environments.", no_args_is_help=True)

TEMPLATES = Path(__file__).resolve().parent / "templates"
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]{0,63}")


@env_app.command("new")
def new_command(
    name: str = typer.Argument(..., help="Environment name, a lowercase Python identifier, e.g. word_echo."),
    directory: Path = typer.Option(None, "--dir", help="Where to write the package (default ./NAME)."),
) -> None:
    """Scaffold an environment package: one module, its test, a pyproject declaring the entry point."""
    if not _IDENTIFIER.fullmatch(name):
        raise typer.BadParameter(
            f"{name!r}: use a lowercase Python identifier (letters, digits, '_', starting with a letter), e.g. word_echo",
            param_hint="NAME",
        )
    directory = directory or Path(name)
    if directory.exists() and any(directory.iterdir()):
        raise typer.BadParameter(f"{directory} exists and is not empty; pick a new --dir", param_hint="--dir")
    fields = {
        "name": name,
        "module": name,
        "class_name": "".join(part.capitalize() for part in name.split("_")),
        "title": name.replace("_", " ").capitalize(),
        "distribution": "clotho-env-" + name.replace("_", "-"),
    }
    directory.mkdir(parents=True, exist_ok=True)
    written = {
        directory / f"{name}.py": "environment.py.txt",
        directory / f"test_{name}.py": "test_environment.py.txt",
        directory / "pyproject.toml": "pyproject.toml.txt",
    }
    for path, template in written.items():
        path.write_text((TEMPLATES / template).read_text().format(**fields))
    typer.echo(f"wrote {', '.join(str(p) for p in written)}")
    # No build isolation: pip would fetch setuptools from the index, which fails offline.
    typer.echo(f"next: pip install --no-build-isolation -e {directory}  then  clotho env check {name}")


@env_app.command("list")
def list_command() -> None:
    """Environments installed in this Python environment (clotho's bundled ones included)."""
    from rich.console import Console
    from rich.table import Table

    from environments.loading import installed_environments, load_environment_class

    table = Table()
    for column in ("name", "import path", "package", "description"):
        table.add_column(column, overflow="fold")  # names and paths are copied: never cut them
    for installed in installed_environments():
        try:
            doc = (load_environment_class(installed.import_path).__doc__ or "").strip().splitlines()
            description = doc[0] if doc else ""
        except ValueError as error:
            description = f"[red]does not load: {error}[/red]"
        table.add_row(installed.name, installed.import_path, installed.distribution, description)
    Console().print(table)


@env_app.command("check")
def check_command(
    environment: str = typer.Argument(
        ...,
        help="Installed name (clotho env list), import path module.path:ClassName, or the URL of `clotho env serve`.",
    ),
    server: str = typer.Option(None, help="Policy server URL (default: start a tiny-model vLLM server for the check)."),
    api_key: str = typer.Option(None, envvar="CLOTHO_API_KEY", help="API key of --server."),
    tokenizer: str = typer.Option(None, help="Tokenizer path or HF id (default: the model the server serves)."),
    set_: list[str] = typer.Option([], "--set", help="Environment config field, key.path=value (YAML value)."),
    startup_timeout_s: float = typer.Option(600.0, min=1.0, help="Seconds to wait for the tiny server to start."),
) -> None:
    """Run the conformance suite on one environment; exit 1 when a check fails."""
    import asyncio

    from rich.console import Console

    from clotho.input_checks import check_server_url, check_tokenizer
    from core.overrides import apply_overrides
    from environments.conformance import run_checks
    from environments.loading import load_config, load_environment_class
    from inference.client import PolicyServerAuthError, served_model

    try:
        env_class = load_environment_class(environment)
    except ValueError as error:  # EnvironmentLoadError
        raise typer.BadParameter(str(error), param_hint="ENVIRONMENT") from None
    try:
        config = apply_overrides({}, set_)
        load_config(env_class, config)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--set") from None
    if server is not None:
        check_server_url(server)
    if tokenizer is not None:
        check_tokenizer(tokenizer)
    console = Console()
    started = None
    if server is None:
        started = _start_tiny_server(startup_timeout_s)
        server, tokenizer = started.base_url, tokenizer or started.model
    try:
        tokenizer = tokenizer or served_model(server, api_key)
        console.print(f"checking {env_class.__module__}:{env_class.__name__} (name {env_class.name}) against {server}")

        def show(result) -> None:
            style = {"passed": "green", "failed": "red", "skipped": "yellow"}[result.status]
            console.print(
                f"[{style}]{result.status:>7}[/{style}]  {result.name}  ({result.seconds:.2f}s)  {result.detail}"
            )

        results = asyncio.run(
            run_checks(env_class, config, server_url=server, tokenizer=tokenizer, api_key=api_key, on_result=show)
        )
    except PolicyServerAuthError as error:
        typer.echo(f"clotho env check: {error}", err=True)
        raise typer.Exit(2) from None
    finally:
        if started is not None:
            started.stop()
    failed = [result for result in results if result.status == "failed"]
    console.print(f"{len(results) - len(failed)} of {len(results)} checks passed or skipped")
    if failed:
        raise typer.Exit(1)


@env_app.command("serve")
def serve_command(
    environment: str = typer.Argument(
        ..., help="Installed name (clotho env list) or import path module.path:ClassName."
    ),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (loopback by default; the API has no key)."),
    port: int = typer.Option(8100, min=1, max=65535, help="Port to listen on."),
    with_: list[str] = typer.Option(
        [],
        "--with",
        help="A package the environment needs beyond this Python environment (repeatable): gymnasium, 'numpy<2'.",
    ),
    requirements: list[str] = typer.Option(
        [],
        "--requirements",
        "-r",
        help="The environment's requirements file, or its project directory (pyproject.toml) (repeatable).",
    ),
) -> None:
    """Serve one environment over HTTP, in this Python environment, for rollouts elsewhere to use by
    URL: `clotho rollout --env http://HOST:PORT ...`, `clotho env check http://HOST:PORT`. With
    --with or --requirements it runs in a layer over this environment holding those too, built
    once and reused (clotho/env_venv.py)."""
    import logging

    if with_ or requirements:
        serve_in_layer(environment, host, port, with_, requirements)
        return

    from environments.loading import EnvironmentLoadError
    from environments.serve import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(environment)
    except EnvironmentLoadError as error:
        raise typer.BadParameter(str(error), param_hint="ENVIRONMENT") from None
    import uvicorn

    typer.echo(f"serving environment {environment} on http://{host}:{port}")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def serve_in_layer(environment: str, host: str, port: int, packages: list[str], requirement_files: list[str]) -> None:
    """`clotho env serve` again, in the layer with the environment's own dependencies (this process
    becomes it: signals and exit codes are the server's)."""
    import os

    from clotho.env_venv import LayerError, environment_layer, pip_arguments

    try:
        python = environment_layer(pip_arguments(packages, requirement_files), echo=typer.echo)
    except LayerError as error:
        raise typer.BadParameter(str(error), param_hint="--with / --requirements") from None
    command = [str(python), "-m", "clotho.cli", "env", "serve", environment, "--host", host, "--port", str(port)]
    os.execv(command[0], command)


def _start_tiny_server(timeout_s: float):
    """The tiny Qwen2 model (built once under .clotho/env-check) served by vLLM for the check."""
    from inference.server import PolicyServer
    from inference.tiny_model import build_tiny_model

    model_dir = Path(".clotho/env-check/tiny-model")
    if not (model_dir / "model.safetensors").exists():
        build_tiny_model(model_dir)
    typer.echo("no --server: starting a tiny-model vLLM server for the check (about a minute on 2 CPU cores)")
    server = PolicyServer(model_dir, log_path=Path(".clotho/env-check/vllm.log"))
    server.start(timeout=timeout_s)
    return server

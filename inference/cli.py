"""`clotho serve --run` and `clotho watch`: keep policy servers at a run's newest verified checkpoint."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import typer

# The watcher pulls in storage (pyarrow) and transformers: imported where used, so mounting these
# commands keeps `clotho --help` fast.
if TYPE_CHECKING:
    from inference.server import PolicyServer
    from inference.watcher import ReloadOutcome

DEFAULT_CACHE = Path(".clotho/reload-cache")  # inference.watcher.DEFAULT_CACHE, without importing it here


def _log_to_stderr() -> None:
    # The watcher reports through logging: every reload (INFO), every rejection and failure (ERROR).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def _echo(outcomes: list[ReloadOutcome]) -> None:
    for outcome in outcomes:
        timing = f" (swap {outcome.swap_s:.3f}s, parity {outcome.parity_s:.3f}s)" if outcome.swap_s is not None else ""
        typer.echo(
            f"{outcome.base_url}: {outcome.status} -> version {outcome.version}{timing}: {outcome.detail}",
            err=outcome.status in ("rejected", "failed"),
        )


def check_watch(model: str | Path, watch: str) -> None:
    """Raises ValueError, naming the fix, unless `serve --model MODEL --run URL` can hot-reload:
    call it before the server starts, not a minute later."""
    from storage.layout import split_run_url

    split_run_url(watch)
    if not (Path(model) / "config.json").exists():
        raise ValueError(
            f"--run needs --model to be a local model directory (the fallback for a rejected checkpoint); "
            f"{model} is not one: download it first (huggingface-cli download) and serve that directory"
        )


async def watch_server(
    server: PolicyServer,
    watch: str,
    *,
    poll_s: float = 2.0,
    cache_dir: str | Path = DEFAULT_CACHE,
    stop: asyncio.Event | None = None,
) -> list[ReloadOutcome]:
    """Hot-reloads a started server onto each new STABLE checkpoint of `watch` (STORAGE_URL/RUN).

    Returns when the vLLM process exits on its own or `stop` is set. A restart fallback replaces the
    process, so only an exit while a process is set ends the watch.
    """
    from inference.parity_guard import ParityGuard
    from inference.reload import ServedPolicy
    from inference.watcher import ReloadWatcher

    guard = ParityGuard.for_model(server.model, dtype=server.dtype, model_name=server.served_model_name)
    watcher = ReloadWatcher(watch, [ServedPolicy.of(server)], guard, cache_dir=cache_dir, poll_s=poll_s)
    typer.echo(f"watching {watch} for checkpoints every {poll_s:g}s (parity tolerance {guard.tolerance:g})")
    stop = stop or asyncio.Event()
    watching = asyncio.create_task(watcher.run(stop=stop, on_outcomes=_echo))
    while not watching.done():
        process = server.process
        if process is not None and process.poll() is not None:
            stop.set()
        await asyncio.wait([watching], timeout=1.0)
    return watching.result()


def serve_watching(
    server: PolicyServer, watch: str, *, poll_s: float = 2.0, cache_dir: str | Path = DEFAULT_CACHE
) -> None:
    """`clotho serve --run`: watch_server until vLLM exits; Ctrl-C raises KeyboardInterrupt as usual."""
    _log_to_stderr()
    asyncio.run(watch_server(server, watch, poll_s=poll_s, cache_dir=cache_dir))


def watch_command(
    run_url: str = typer.Option(..., "--run", help="Run URL STORAGE_URL/RUN to follow, e.g. s3://bucket/runs/myrun."),
    server: list[str] = typer.Option(..., "--server", help="Base URL of a running vLLM server; repeat for several."),
    base_model: Path = typer.Option(..., help="Local directory of the weights the servers were started on."),
    api_key: str = typer.Option(None, envvar="CLOTHO_API_KEY", help="API key of the servers' dev routes."),
    served_model_name: str = typer.Option("policy", help="Model name the servers serve."),
    dtype: str = typer.Option("float32", help="Dtype the servers run in; sets the parity tolerance."),
    poll_s: float = typer.Option(2.0, help="Seconds between looks at the run."),
    cache_dir: Path = typer.Option(DEFAULT_CACHE, help="Where remote checkpoints are copied to."),
    once: bool = typer.Option(False, "--once", help="Bring the servers up to date once and exit."),
    reload_mode: str = typer.Option(
        "in-flight",
        help="in-flight: generation goes on across a reload; drain: requests in flight finish on the old weights first.",
    ),
    reload_step_timeout_s: float = typer.Option(
        120.0,
        min=0.1,
        help="Seconds each call of a reload may take; a server that does not answer twice is restored (inference.reload.reload_bound_s).",
    ),
) -> None:
    """Keep running vLLM servers (started with VLLM_SERVER_DEV_MODE=1) at the run's newest checkpoint."""
    from inference.parity_guard import ParityGuard
    from inference.reload import ServedPolicy
    from inference.watcher import ReloadWatcher
    from storage.layout import split_run_url

    _log_to_stderr()
    try:
        split_run_url(run_url)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--run") from error
    if not (base_model / "config.json").exists():
        raise typer.BadParameter(
            f"{base_model} has no config.json; pass the local model directory", param_hint="--base-model"
        )
    if reload_mode not in ("in-flight", "drain"):
        raise typer.BadParameter(f"{reload_mode!r}: use in-flight or drain", param_hint="--reload-mode")
    guard = ParityGuard.for_model(base_model, dtype=dtype, model_name=served_model_name)
    policies = [
        ServedPolicy(
            url.rstrip("/"),
            base_model,
            api_key=api_key,
            model_name=served_model_name,
            reload_mode=reload_mode,
            step_timeout_s=reload_step_timeout_s,
        )
        for url in server
    ]
    watcher = ReloadWatcher(run_url, policies, guard, cache_dir=cache_dir, poll_s=poll_s)
    try:
        history = asyncio.run(watcher.run(max_polls=1 if once else None, on_outcomes=_echo))
    except KeyboardInterrupt:
        return
    if once and any(outcome.status == "failed" for outcome in history):
        raise typer.Exit(1)

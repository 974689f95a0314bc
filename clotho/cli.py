"""The `clotho` command line: one entry point over every stage of the data flow."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from clotho.flow_runtime import (
    PrefectStartError,
    Stopped,
    make_prefect_home,
    quiet_terminal,
    run_flow,
    start_local_prefect_server,
)
from clotho.input_checks import check_model, check_server_url, check_tokenizer
from clotho.shortfall import SHORTFALL_EXIT, shortfall
from core.validation import describe_validation_error
from storage.filesystem import StorageUnavailableError
from tasks.api_key import API_KEY_VARIABLE


class OneLineErrors(TyperGroup):
    """clotho's command group: a usage error (an unknown option, a bad value, a config that does not
    validate) is one line on stderr, `clotho COMMAND: what; fix`, with exit code 2; no usage box,
    no traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        with contextlib.suppress(PrefectStartError):  # before prefect is imported; said when a flow starts
            make_prefect_home()
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as error:  # typer's click exceptions (UsageError, BadParameter, ...)
            if type(error).__name__ == "NoArgsIsHelpError":  # as typer tells it: the help is printed already
                sys.exit(error.exit_code)
            context = getattr(error, "ctx", None)
            where = context.command_path if context is not None else (prog_name or "clotho")
            typer.echo(f"{where}: {' '.join(error.format_message().split())}", err=True)
            sys.exit(error.exit_code)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        except (StorageUnavailableError, PrefectStartError) as error:  # waited for already: say it once
            typer.echo(f"{prog_name or 'clotho'}: {error}", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)  # an Exit's code, else success


app = typer.Typer(help="clotho: RL for language models through environments.", no_args_is_help=True, cls=OneLineErrors)
# Help read through a pipe (a pager, a file, an agent) gets 120 columns rather than rich's 80, where
# the options' defaults were cut; a terminal keeps its own width. Typer reads TERMINAL_WIDTH when it
# first renders help.
os.environ.setdefault("TERMINAL_WIDTH", str(shutil.get_terminal_size((120, 24)).columns))
from clotho.model_cli import model_app  # noqa: E402  (imports nothing heavy until it runs)

app.add_typer(model_app, name="model")

try:  # storage ships the shard commands; mounted here so `clotho shards ...` works
    from storage.cli import shards_app

    app.add_typer(shards_app, name="shards")
except ImportError:  # pragma: no cover - storage not installed in a minimal environment
    pass


from trainer.cli import train_command  # noqa: E402  (imports nothing heavy until it runs)

app.command("train")(train_command)

from clotho.env_cli import env_app  # noqa: E402  (imports nothing heavy until it runs)

app.add_typer(env_app, name="env")


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


@app.command()
def serve(
    model: str = typer.Option(
        ..., help="Local model directory, storage URL of one (s3://...) or Hugging Face model id."
    ),
    port: int = typer.Option(8000, min=1, max=65535, help="Port of the OpenAI-compatible API."),
    host: str = typer.Option("127.0.0.1", help="Bind address; anything but loopback needs --api-key."),
    api_key: str = typer.Option(None, envvar="CLOTHO_API_KEY", help="API key the server requires."),
    served_model_name: str = typer.Option("policy", help="Model name clients ask for."),
    log_file: Path = typer.Option(None, help="Server log (default .clotho/logs/vllm-PORT.log)."),
    dtype: str = typer.Option("float32", help="Weights dtype: float32 on CPU, bfloat16 on GPUs."),
    max_model_len: int = typer.Option(2048, min=1, help="Longest sequence the server accepts."),
    startup_timeout_s: float = typer.Option(600.0, min=1.0, help="Seconds to wait for /health."),
    run: str = typer.Option(None, help="Run URL STORAGE_URL/RUN: hot-reload each new STABLE checkpoint of that run."),
    poll_s: float = typer.Option(2.0, min=0.01, help="With --run: seconds between looks at the run."),
    priority: str = typer.Option(
        None,
        help="CPU priority of vLLM's processes: normal, low (niceness 10) or idle (SCHED_IDLE: only cycles "
        "nothing else wants). Default: idle for vLLM on CPUs, below the rollout clients and Prefect sharing its "
        "cores; normal for GPUs.",
    ),
) -> None:
    """Start the vLLM policy server, wait until healthy, and keep it up until Ctrl-C."""
    from inference.server import PolicyServer, ServerStartError

    check_model(model)
    from storage.models import local_model

    model = local_model(model)  # a model in storage: this host's copy, fetched once
    if dtype not in SERVER_DTYPES:
        raise typer.BadParameter(f"{dtype!r}: use one of {', '.join(SERVER_DTYPES)}", param_hint="--dtype")
    if run:
        _split_run(run)
    try:
        server = PolicyServer(
            model,
            host=host,
            port=port,
            api_key=api_key,
            served_model_name=served_model_name,
            log_path=log_file,
            dtype=dtype,
            max_model_len=max_model_len,
            priority=priority,
        )
        if run:
            from inference.cli import check_watch

            check_watch(model, run)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    typer.echo(f"starting vLLM ({server.python}) for {model}; log: {server.log_path}")
    # SIGTERM behaves like Ctrl-C so a supervisor's stop also takes the workers down; SIGINT is set
    # explicitly because a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        server.start(timeout=startup_timeout_s)
        typer.echo(
            f"policy server ready at {server.base_url} (OpenAI API under /v1, model name '{served_model_name}'): "
            f"pass --server {server.base_url}; Ctrl-C stops it"
        )
        if run:
            from inference.cli import serve_watching

            serve_watching(server, run, poll_s=poll_s)  # returns when vLLM exits
        while server.process is not None and server.process.poll() is None:
            time.sleep(1)
        typer.echo(f"vLLM exited on its own; see {server.log_path}", err=True)
        raise typer.Exit(1)
    except ServerStartError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("stopping policy server")
    finally:
        server.stop()


# What vLLM's --dtype takes.
SERVER_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")


def _split_run(run_url: str, option: str = "--run") -> tuple[str, str]:
    from storage.cli import check_run_url

    try:
        return check_run_url(run_url)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint=option) from None


@app.command()
def rollout(
    env: list[str] = typer.Option(
        ...,
        help="Environment: an installed name (clotho env list) or an import path "
        "module.path:ClassName (repeatable; mixed by equal weight).",
    ),
    run: str = typer.Option(
        ..., help="Run URL STORAGE_URL/RUN: a local dir, file://, s3://bucket/prefix/RUN, memory://."
    ),
    server: list[str] = typer.Option(["http://127.0.0.1:8000"], help="Policy server base URL (repeatable)."),
    api_key: str = typer.Option(
        None, envvar="CLOTHO_API_KEY", help="API key of the policy servers (clotho serve --api-key)."
    ),
    groups: int = typer.Option(64, min=1, help="Groups to collect (see --forever)."),
    forever: bool = typer.Option(False, "--forever", help="Collect until Ctrl-C or a cancel, ignoring --groups."),
    tokenizer: str = typer.Option(None, help="Tokenizer path or HF id (default: the model the first server serves)."),
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="Environment config field, key.path=value with a YAML value, "
        "e.g. --set group_size=8 (applies to every --env).",
    ),
    max_concurrent_groups: int = typer.Option(8, min=1, max=4096, help="Groups in flight at once."),
    shard_max_groups: int = typer.Option(64, min=1, help="Flush a shard after this many groups."),
    shard_max_age_s: float = typer.Option(
        30.0, min=0.0, help="Flush a shard when its oldest group is this many seconds old."
    ),
    max_lag: int = typer.Option(
        None,
        min=0,
        help="Bounded staleness K: start a group only if the trainer will train it at most K policy versions after "
        "the one it samples with (reads the trainer's progress; 0 is the synchronous loop).",
    ),
    dask: str = typer.Option(None, help="Address of a Dask scheduler to run the tasks on (prefect-dask)."),
    server_concurrency: int = typer.Option(
        None, min=1, help="Groups in flight per server across all flows (a Prefect concurrency limit)."
    ),
    task_run_s: float = typer.Option(
        10.0,
        min=0.0,
        help="A lane's Prefect task run samples groups one after another for about this many seconds "
        "(0: a task run per group); Prefect's per-task-run cost is paid once per task run.",
    ),
) -> None:
    """Run the rollout flow directly (ephemeral Prefect), without a deployment."""
    from core.overrides import apply_overrides
    from environments.loading import load_config, load_environment_class
    from inference.client import PolicyServerAuthError

    _split_run(run)  # a bad URL is named before anything starts
    for url in server:
        check_server_url(url)
    try:
        config = apply_overrides({}, set_)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--set") from None
    for path in env:
        try:
            env_class = load_environment_class(path)
        except ValueError as error:  # EnvironmentLoadError
            raise typer.BadParameter(str(error), param_hint="--env") from None
        try:
            load_config(env_class, config)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--set") from None
    from tasks.rollout import EnvSpec  # imports prefect: after the checks that need none

    specs = [EnvSpec(import_path=path, config=config) for path in env]
    if tokenizer is None:
        from inference.client import served_model

        try:
            tokenizer = served_model(server[0], api_key)
        except PolicyServerAuthError as error:
            typer.echo(f"clotho rollout: {error}", err=True)
            raise typer.Exit(2) from None
        except Exception as error:  # noqa: BLE001 - whatever failed, the fix is the same option
            raise typer.BadParameter(
                f"--tokenizer not given and {server[0]}/v1/models did not say the model ({error}); pass --tokenizer "
                "or check --server and --api-key",
                param_hint="--tokenizer",
            ) from None
    check_tokenizer(tokenizer)
    start_local_prefect_server()
    if api_key:
        # The flow reads the key from its process's environment, never from a parameter: flow
        # parameters are stored with the flow run and shown in the UI.
        os.environ[API_KEY_VARIABLE] = api_key
    from flows.rollout import rollout as rollout_flow

    flow = rollout_flow
    if dask:
        from prefect_dask import DaskTaskRunner

        flow = rollout_flow.with_options(task_runner=DaskTaskRunner(address=dask))
    try:
        summary = run_flow(
            flow(
                environments=specs,
                servers=server,
                run_url=run,
                tokenizer=tokenizer,
                groups=None if forever else groups,
                max_concurrent_groups=max_concurrent_groups,
                shard_max_groups=shard_max_groups,
                shard_max_age_s=shard_max_age_s,
                max_lag=max_lag,
                distributed=bool(dask),
                server_concurrency=server_concurrency,
                task_run_s=task_run_s,
            )
        )
    except PolicyServerAuthError as error:
        typer.echo(f"clotho rollout: {error}", err=True)
        raise typer.Exit(2) from None
    except Stopped as stopped:
        typer.echo(f"clotho rollout: stopped by {stopped}; every finished group is stored under {run}", err=True)
        raise typer.Exit(128 + stopped.signum) from None
    typer.echo(f"done: {summary['totals']}")
    totals = summary["totals"]
    failed = shortfall("clotho rollout", "groups", totals["groups"], totals["failures_by_reason"], ", ".join(server))
    if failed:
        typer.echo(failed, err=True)
        raise typer.Exit(SHORTFALL_EXIT)


from inference.cli import watch_command  # noqa: E402 - typer only, imports nothing heavy

app.command("watch")(watch_command)


@app.command("run")
def run_pipeline(
    config: Path = typer.Argument(
        ...,
        exists=True,
        dir_okay=False,
        help="Pipeline YAML (flows.pipeline_config.PipelineConfig), e.g. runs/demo.yaml.",
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a field, key.path=value with a YAML value: --set max_lag=0 (repeatable)."
    ),
    api_key: str = typer.Option(None, envvar="CLOTHO_API_KEY", help="API key of the policy servers."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also print every task run's state and the model-loading progress bars."
    ),
) -> None:
    """Run the whole loop for one run: policy servers with hot reload, rollout flows and the
    trainer, asynchronous with bounded staleness, phase after phase, until the last step."""
    pipeline_config = check_pipeline(config, set_)
    start_local_prefect_server()
    if api_key:
        os.environ[API_KEY_VARIABLE] = api_key
    from flows.pipeline import pipeline

    quiet_terminal(verbose)

    try:
        summary = run_flow(pipeline(config_path=str(config), overrides=list(set_)))
    except Stopped as stopped:
        typer.echo(
            f"clotho run: stopped by {stopped}; every finished group is stored under {pipeline_config.run}", err=True
        )
        raise typer.Exit(128 + stopped.signum) from None
    typer.echo(
        json.dumps({key: value for key, value in summary.items() if key not in ("curve", "completions")}, indent=1)
    )
    if completions := summary.get("completions"):
        from flows.completions import completions_text

        typer.echo(completions_text(completions), err=True)  # stdout: the summary's JSON alone


def check_pipeline(path: Path, overrides: list[str]) -> Any:
    """The pipeline config of `clotho run`, checked whole before anything starts: its fields, the run
    URL, the model, the servers' URLs, every environment and its config, and each phase's trainer
    settings; typer.BadParameter naming the field otherwise."""
    import yaml
    from pydantic import ValidationError

    from environments.loading import load_config, load_environment_class
    from flows.pipeline_config import PipelineConfig
    from trainer.config import TrainerConfig

    def bad(field: str, message: str) -> typer.BadParameter:
        return typer.BadParameter(f"{field}: {message}", param_hint=f"{path}")

    try:
        config = PipelineConfig.from_yaml(path, overrides)
    except yaml.YAMLError as error:
        raise bad("(file)", f"not valid YAML ({' '.join(str(error).split())}); fix the file") from None
    except ValidationError as error:
        raise typer.BadParameter(describe_validation_error(error, PipelineConfig), param_hint=f"{path}") from None
    except ValueError as error:  # an --set that does not apply, a top level that is not a mapping
        raise typer.BadParameter(str(error), param_hint=f"{path}") from None
    _split_run(config.run, option=f"{path}: run")
    check_model(config.model, option=f"{path}: model")
    for index, url in enumerate(config.servers.urls):
        check_server_url(url, option=f"{path}: servers.urls.{index}")
    entries = [
        (f"phases.{p}.environments.{e}", entry.env, entry.config)
        for p, phase in enumerate(config.phases)
        for e, entry in enumerate(phase.environments)
    ]
    if config.evaluation is not None:
        entries.append(("evaluation", config.evaluation.env, config.evaluation.config))
    for field, name, env_config in entries:
        try:
            load_config(load_environment_class(name), env_config)
        except ValueError as error:  # EnvironmentLoadError
            raise bad(field, str(error)) from None
    for index, phase in enumerate(config.phases):
        fields = {**config.trainer_fields(phase), "model": config.model, "steps": phase.steps}
        try:
            TrainerConfig.model_validate(fields)
        except ValidationError as error:
            problem = describe_validation_error(error, TrainerConfig)
            raise bad(
                f"trainer (phases.{index}, {phase.name})", f"{problem}; set it in trainer or phases.{index}.trainer"
            ) from None
    return config


from clotho.offline_cli import evaluate_command, reprocess_command  # noqa: E402  (imports nothing heavy until it runs)

app.command("reprocess")(reprocess_command)
app.command("evaluate")(evaluate_command)


@app.command()
def demo(
    workdir: Path = typer.Option(
        None, help="Where the model, the run and the curve go (default .clotho/demo, with --tiny .clotho/demo-tiny)."
    ),
    tiny: bool = typer.Option(
        False, "--tiny", help="The small random model of runs/demo.yaml (SFT, then RL; ~2 minutes) instead of SmolLM2."
    ),
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="Override a field of the run's config, e.g. --set phases.0.steps=30 "
        "(runs/smollm2-times-tables.yaml; with --tiny runs/demo.yaml).",
    ),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also print every task run's state and the model-loading progress bars."
    ),
) -> None:
    """A real model learns, from nothing: get SmolLM2-135M-Instruct (cached), then RL on the times
    tables (runs/smollm2-times-tables.yaml); with --tiny the small random model of runs/demo.yaml,
    SFT then RL. Ends with the learning curve (summary.json, reward-curve.png) and sampled completions."""
    import prefect.main  # noqa: F401  (sets up Prefect's logging, which quiet_terminal filters)

    from clotho.demo import run_demo

    start_local_prefect_server()
    quiet_terminal(verbose)

    try:
        run_demo(workdir or Path(".clotho/demo-tiny" if tiny else ".clotho/demo"), run_flow, list(set_), tiny)
    except Stopped as stopped:
        typer.echo(f"clotho demo: stopped by {stopped}", err=True)
        raise typer.Exit(128 + stopped.signum) from None


if __name__ == "__main__":
    app()

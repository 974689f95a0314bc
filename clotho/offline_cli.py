"""`clotho reprocess` and `clotho evaluate`: the offline commands, over stored shards and
published checkpoints (flows/reprocess.py, flows/evaluate.py)."""

from __future__ import annotations

import json
import os

import typer

from clotho.shortfall import SHORTFALL_EXIT, shortfall
from tasks.api_key import API_KEY_VARIABLE


def reprocess_command(
    input_run: str = typer.Argument(..., help="The run to read, STORAGE_URL/RUN; it is never changed."),
    output: str = typer.Argument(..., help="A new run URL, or a dataset directory for export-sft / export-dpo."),
    operations: list[str] = typer.Argument(
        ...,
        help="OP or OP:key=value,...: filter, advantages, dedupe, rescore, "
        "compact, export-sft, export-dpo, applied in order (tasks/reprocess.py).",
    ),
) -> None:
    """Reprocess stored shards offline into a new dataset: rescore, recompute advantages, filter,
    dedupe, compact, or export SFT / DPO sets (a Prefect flow; lineage in OUTPUT/lineage.json)."""
    from clotho.flow_runtime import drain_prefect_reporting, start_local_prefect_server
    from flows.reprocess import check_job
    from flows.reprocess import reprocess as reprocess_flow
    from storage.cli import check_url

    for argument, url in (("INPUT_RUN", input_run), ("OUTPUT", output)):
        try:
            check_url(url)
        except ValueError as error:
            typer.echo(f"clotho reprocess: {argument}: {error}", err=True)
            raise typer.Exit(2) from None
    try:
        check_job(input_run, output, operations)  # every check that needs no full pass; writes nothing
    except ValueError as error:  # ReprocessError, a malformed URL
        typer.echo(f"clotho reprocess: {error}", err=True)
        raise typer.Exit(2) from None
    start_local_prefect_server()
    try:
        lineage = reprocess_flow(input_run_url=input_run, output_url=output, operations=list(operations))
    except ValueError as error:  # found in the full pass: a filter that matched nothing
        typer.echo(f"clotho reprocess: {error}", err=True)
        raise typer.Exit(2) from None
    finally:
        drain_prefect_reporting()
    typer.echo(json.dumps(lineage["counts"]))


def evaluate_command(
    env: str = typer.Option(..., help="Environment: an installed name (clotho env list) or module.path:ClassName."),
    checkpoint: str = typer.Option(
        "LATEST", help="A published step URL (.../checkpoints/step-N), or LATEST or BEST (the best evaluated) of --run."
    ),
    run: str = typer.Option(None, help="Run URL STORAGE_URL/RUN, for --checkpoint LATEST or BEST."),
    set_: list[str] = typer.Option([], "--set", help="Environment config field, key.path=value (YAML value)."),
    items: int = typer.Option(50, min=1, help="Held-out items to answer (greedy)."),
    server: str = typer.Option(
        None, help="Use this running server (it must serve the checkpoint's version) instead of serving it here."
    ),
    api_key: str = typer.Option(None, envvar="CLOTHO_API_KEY", help="API key of --server."),
    force: bool = typer.Option(False, "--force", help="Evaluate again even if a result for this step and env exists."),
) -> None:
    """Evaluate one checkpoint on an environment's held-out items; the result goes next to the
    checkpoint (evaluation-ENV.json) and into the Prefect UI."""
    from clotho.flow_runtime import drain_prefect_reporting, start_local_prefect_server
    from core.overrides import apply_overrides
    from flows.evaluate import EvaluationError, find_checkpoint
    from flows.evaluate import evaluate as evaluate_flow

    try:
        env_config = apply_overrides({}, set_)
        find_checkpoint(checkpoint, run)
    except ValueError as error:  # EvaluationError, a malformed URL or --set
        typer.echo(f"clotho evaluate: {error}", err=True)
        raise typer.Exit(2) from None
    if api_key:
        os.environ[API_KEY_VARIABLE] = api_key  # read by the flow, never one of its parameters
    start_local_prefect_server()
    try:
        result = evaluate_flow(
            env=env, checkpoint=checkpoint, run_url=run, env_config=env_config, items=items, server=server, force=force
        )
    except EvaluationError as error:
        typer.echo(f"clotho evaluate: {error}", err=True)
        raise typer.Exit(2) from None
    finally:
        drain_prefect_reporting()
    report = result["report"]
    typer.echo(json.dumps({"step": result["step"], "env": result["env"], **report}))
    reasons = {
        key.removeprefix("failures/"): int(count) for key, count in report.items() if key.startswith("failures/")
    }
    answered = int(report.get("items", 0))
    failed = shortfall("clotho evaluate", "items answered", answered, reasons, server or "")
    if failed:
        typer.echo(failed, err=True)
        raise typer.Exit(SHORTFALL_EXIT)

"""`clotho shards ls|show|verify|compact`: look at and maintain the shards under any fsspec URL."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.scored_group import ScoredGroup, ScoredSequence

shards_app = typer.Typer(
    help="Inspect rollout shards (Parquet) under a run, rollouts/ or partition URL: file://, s3://, memory://...",
    no_args_is_help=True,
)
console = Console()

URL = Annotated[str, typer.Argument(help="A run, its rollouts/ directory, a partition, or one shard file.")]


def check_url(url: str) -> str:
    """A storage URL whose protocol fsspec knows, or ValueError naming the fix."""
    import fsspec

    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(
            f"{url!r}: unknown storage protocol {protocol!r}; use a local path, file://, s3:// or memory://"
        ) from None
    except ImportError as error:
        raise ValueError(
            f"{url!r}: the package for {protocol}:// is not installed ({error}); install it (s3fs for s3://)"
        ) from None
    return url


def check_run_url(url: str) -> tuple[str, str]:
    """(storage, run) of a run URL STORAGE_URL/RUN, checked before anything opens it: its shape, its
    run name and its protocol; ValueError naming the fix otherwise."""
    from storage.layout import split_run_url

    return split_run_url(check_url(url))


def _checked(url: str) -> str:
    """The URL argument of a shards command, or a usage error (exit 2) naming it and the fix."""
    from storage.filesystem import resolve

    try:
        check_url(url)
        fs, path = resolve(url)
        missing = not fs.exists(path)
    except (ValueError, OSError) as error:
        raise typer.BadParameter(" ".join(str(error).split()), param_hint="URL") from None
    if missing:
        raise typer.BadParameter(
            f"{url} does not exist; give a run, its rollouts/, a partition or a shard file", param_hint="URL"
        )
    return url


@shards_app.command("ls")
def list_command(url: URL) -> None:
    """List shards with their partition, group and sequence counts and bytes (footers only)."""
    from storage.inspection import summarize

    summaries = summarize(_checked(url))
    if not summaries:
        console.print(f"no shards under {url}")
        return
    table = Table("shard", "groups", "sequences", "bytes", "tokenizer")
    for summary in summaries:
        if summary.error:
            table.add_row(
                summary.shard.name,
                "-",
                "-",
                f"{summary.shard.size:,}",
                Text(summary.error, style="red"),
            )
        else:
            table.add_row(
                summary.shard.name,
                str(summary.groups),
                str(summary.sequences),
                f"{summary.shard.size:,}",
                summary.tokenizer,
            )
    table.add_section()
    table.add_row(
        f"{len(summaries)} shards",
        str(sum(s.groups for s in summaries if s.groups is not None)),
        str(sum(s.sequences for s in summaries if s.sequences is not None)),
        f"{sum(s.shard.listed_size for s in summaries):,}",
        "",
    )
    console.print(table)


@shards_app.command("show")
def show_command(
    url: URL,
    group: Annotated[int, typer.Option(help="Index of the group within the shard.")] = 0,
    shard: Annotated[int, typer.Option(help="Index of the shard under URL, oldest first.")] = 0,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer name or path to decode tokens to text.")] = None,
) -> None:
    """Print one group decoded; the trained tokens (mask True) are highlighted."""
    from storage.schema import table_to_groups
    from storage.shard_file import find_shards, read_shard

    fs, shards = find_shards(_checked(url))
    if not 0 <= shard < len(shards):
        raise typer.BadParameter(f"--shard {shard}: {url} has {len(shards)} shards", param_hint="--shard")
    groups = table_to_groups(read_shard(fs, shards[shard]))
    if not 0 <= group < len(groups):
        raise typer.BadParameter(f"--group {group}: the shard has {len(groups)} groups", param_hint="--group")
    decode = _decoder(tokenizer)
    _print_group(shards[shard].url, groups[group], decode)


@shards_app.command("verify")
def verify_command(url: URL) -> None:
    """Read every shard whole and check schema, invariants and duplicates; exit 1 on any problem."""
    from storage.inspection import verify

    checks = verify(_checked(url))
    table = Table("shard", "groups", "sequences", "tokens", "status")
    for check in checks:
        problems = len(check.problems)
        status = (
            Text("ok", style="green")
            if not problems
            else Text(f"{problems} problem{'s' * (problems > 1)}", style="red")
        )
        table.add_row(check.shard.name, str(check.groups), str(check.sequences), f"{check.tokens:,}", status)
    console.print(table)
    # Each problem whole on lines of its own (they name the shard's URL), not wrapped in a cell.
    for check in checks:
        for problem in check.problems:
            console.print(Text(problem, style="red"), soft_wrap=True)
    bad = sum(1 for check in checks if check.problems)
    console.print(f"{len(checks)} shards checked, {bad} with problems")
    if bad:
        raise typer.Exit(1)


@shards_app.command("compact")
def compact_command(
    url: URL,
    target_mb: Annotated[float, typer.Option(min=0.001, help="Size of the merged shards, in MiB.")] = 128.0,
) -> None:
    """Merge each partition's small shards into larger ones (not while a trainer consumes them)."""
    from storage.compact import compact

    merged = compact(_checked(url), target_bytes=int(target_mb * 2**20))
    for compaction in merged:
        console.print(f"{compaction.url}: {compaction.rows} rows from {len(compaction.sources)} shards")
    console.print(f"{len(merged)} merged shards written")


@shards_app.command("index")
def index_command(
    run_url: Annotated[str, typer.Argument(help="The run (STORAGE_URL/RUN).")],
) -> None:
    """Index shards copied into a run by hand: trainers find new shards through the run's index."""
    from storage.index import index_shards

    try:
        check_run_url(run_url)  # a run's URL, or the error says what one looks like
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="RUN_URL") from None
    if not index_shards(run_url):
        console.print(f"{run_url} holds no shards")
        raise typer.Exit(1)
    console.print(f"{run_url}: every shard is indexed")


def _decoder(tokenizer: str | None) -> Any:
    if tokenizer is None:
        return lambda tokens: " ".join(map(str, tokens)) + " "
    from transformers import AutoTokenizer  # heavy; only when text is asked for

    loaded = AutoTokenizer.from_pretrained(tokenizer)
    return lambda tokens: loaded.decode(tokens)


def _print_group(url: str, group: ScoredGroup, decode: Any) -> None:
    created = datetime.fromtimestamp(group.created_at, tz=UTC).isoformat()
    console.print(f"[bold]{url}[/bold]")
    console.print(
        f"env {group.env}  item {group.item_id}  group {group.group_id}  "
        f"policy_version {group.policy_version}  created {created}  scores {group.scores}"
    )
    if group.chat_template:
        console.print(f"chat template {group.chat_template}")
    if group.extras:
        console.print(f"extras {json.dumps(group.extras, ensure_ascii=False)}")
    console.print(Text("trained tokens", style="bold green"), "are highlighted")
    for index, sequence in enumerate(group.sequences):
        console.rule(
            f"sequence {index}: score {sequence.score}  finish {sequence.finish_reason}  "
            f"tokens {len(sequence.tokens)}  trained {sequence.num_trained_tokens}"
        )
        console.print(_highlight(sequence, decode))
        for message in sequence.messages or []:
            console.print(Text(f"{message.get('role', '?')}: {message.get('content', '')}", style="cyan"))
        if sequence.extras:
            console.print(f"extras {json.dumps(sequence.extras, ensure_ascii=False)}")


def _highlight(sequence: ScoredSequence, decode: Any) -> Text:
    """Decode runs of equal mask separately, so the highlight falls exactly on the trained tokens."""
    text = Text()
    start = 0
    for end in range(1, len(sequence.tokens) + 1):
        if end == len(sequence.tokens) or sequence.mask[end] != sequence.mask[start]:
            style = "bold green" if sequence.mask[start] else "dim"
            text.append(decode(sequence.tokens[start:end]), style=style)
            start = end
    return text

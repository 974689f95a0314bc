"""The `reprocess` flow: stored shards in, a new dataset out, the input never touched.

    clotho reprocess INPUT_RUN_URL OUTPUT_URL OP [OP ...]      (operations: tasks/reprocess.py)

Reads top to bottom: check the operations (and run them on the first shard, so a bad column or
environment fails before anything is written); a dedupe pass over the whole input when asked; then
one task per shard (per bin of small shards with `compact`), mapped (as many at once as there are
cores: memory is a few shards, whatever the input's size), retried, each writing one
output file named after its first input shard. The output is a run (shards with their index, for
a trainer or another reprocess) or, for an export, a Hugging Face `datasets` Parquet directory
(`data/*.parquet`). An output file that exists is complete (shards are published atomically) and
is skipped, so the same job run again, or killed and run again, finishes with the same output and
no duplicate rows. `{output}/lineage.json` and a Prefect artifact record the inputs, operations,
code version and counts.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from flows.artifacts import artifact_key
from storage.filesystem import is_local, publish, resolve, storage_errors
from storage.index import add_entry, drop_unpublished
from storage.layout import ROLLOUTS, TEMPORARY, ShardLocation, join, new_shard_id, rollouts_url, split_run_url
from storage.schema import (
    METADATA_COMPACTED_FROM,
    METADATA_NUM_GROUPS,
    METADATA_REPROCESSED_FROM,
    METADATA_TOKENIZER,
    concat_shard_tables,
    reprocessed_from,
    table_to_groups,
)
from storage.shard_file import ShardInfo, find_shards, read_footers, read_shard, write_shard
from tasks.exports import EXPORT_FUNCTIONS
from tasks.reprocess import (
    EXPORTS,
    Context,
    Operation,
    ReprocessError,
    RescoreArgs,
    apply,
    check_operations,
    duplicate_rows,
    make_rescorer,
    parse_operation,
)

JOB = "_reprocess/job.json"
LINEAGE = "lineage.json"


@dataclass(frozen=True)
class Job:
    """Everything a task needs, picklable for the task runner."""

    input_run_url: str
    output_url: str
    operations: list[Operation]

    @property
    def export(self) -> str | None:
        return self.operations[-1].name if self.operations[-1].name in EXPORTS else None

    def export_path(self, first: ShardInfo) -> str:
        """The export file of a bin whose first input shard is `first`: named after it. (A run's
        output shards get new ids when written, see process_bin, and name their inputs.)"""
        _, base = resolve(self.output_url)
        return join(base, "data", f"{first.location.shard_id}.parquet")


def written_bins(job: Job) -> dict[str, str]:
    """First input shard name -> output shard path, for the bins an earlier run of the job wrote
    into the output run (the input shards each output shard names in its metadata), so a job
    run again skips them."""
    fs, shards = find_shards(rollouts_url(*split_run_url(job.output_url)))
    written = {}
    for shard, footer in zip(shards, read_footers(fs, shards) if shards else [], strict=True):
        if isinstance(footer, Exception):
            raise footer
        if sources := reprocessed_from(footer.metadata):
            written[sources[0]] = shard.path
    return written


def plan_operations(operations: list[str]) -> list[Operation]:
    return check_operations([parse_operation(text) for text in operations])


def bins(shards: list[ShardInfo], operations: list[Operation]) -> list[list[ShardInfo]]:
    """One shard per bin, or with `compact` consecutive shards of a partition up to target_mb."""
    compact = next((op for op in operations if op.name == "compact"), None)
    if compact is None:
        return [[shard] for shard in shards]
    target = compact.args.target_mb * 2**20
    result: list[list[ShardInfo]] = []
    open_bins: dict[str, tuple[list[ShardInfo], float]] = {}
    for shard in shards:
        partition = posixpath.dirname(shard.name)
        current, size = open_bins.get(partition, ([], 0.0))
        if current and size + (shard.size or 0) > target:
            result.append(current)
            current, size = [], 0.0
        current.append(shard)
        open_bins[partition] = (current, size + (shard.size or 0))
    result += [current for current, _ in open_bins.values() if current]
    return sorted(result, key=lambda b: b[0].location.shard_id)


def transformed(job: Job, shard: ShardInfo, fs: Any, duplicates: set[int]) -> tuple[pa.Table, pa.Table]:
    """(input table, table after the non-export operations) of one shard."""
    table = read_shard(fs, shard)
    context = Context(duplicates=duplicates)
    rescore = next((op for op in job.operations if op.name == "rescore"), None)
    if rescore is not None:
        context.rescore = _rescorer(rescore.args.model_dump_json(), table.schema.metadata[METADATA_TOKENIZER].decode())
    return table, apply(table, job.operations, context)


@functools.lru_cache(maxsize=4)
def _rescorer(args_json: str, tokenizer: str) -> Any:
    """One environment (and tokenizer) per rescore and tokenizer, not one per shard."""
    return make_rescorer(RescoreArgs.model_validate_json(args_json), tokenizer)


@functools.lru_cache(maxsize=4)
def _decoder(tokenizer: str) -> Any:
    """`ids -> text` with the tokenizer, or None when it cannot be loaded here."""
    from transformers import AutoTokenizer

    try:  # a local directory or the Hugging Face cache: an export never waits on the network
        loaded = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (OSError, ValueError):
        return None
    return lambda ids: loaded.decode(ids, skip_special_tokens=True)


def export_table(job: Job, table: pa.Table) -> pa.Table:
    """The export's rows: messages where stored, prompt/completion text decoded by the shards'
    tokenizer (or the export's `tokenizer`) where it loads, token ids always."""
    operation = job.operations[-1]
    tokenizer = operation.args.tokenizer or table.schema.metadata[METADATA_TOKENIZER].decode()
    decode = _decoder(tokenizer)
    if decode is None and table.column("messages").null_count:
        raise ReprocessError(
            f"operation {operation.name}: sequences without stored messages need their text decoded, and tokenizer "
            f"{tokenizer!r} does not load here; pass {operation.name}:tokenizer=PATH (the shards' tokenizer)"
        )
    rows = EXPORT_FUNCTIONS[operation.name](table_to_groups(table, validated=True), operation.args, decode)
    return pa.Table.from_pylist(rows)


@task(name="reprocess shards", retries=2, retry_delay_seconds=2)
def process_bin(
    job: Job, shards: list[ShardInfo], duplicates: dict[str, set[int]], written: str | None = None
) -> dict[str, int]:
    """One output file from `shards` (already there: skipped; for a run, `written` is where an
    earlier run of the job wrote it); the counts in and out."""
    in_fs, _ = resolve(job.input_run_url)
    out_fs, out_base = resolve(job.output_url)
    path = job.export_path(shards[0]) if job.export else written
    counts = {"shards_in": len(shards), "rows_in": 0, "groups_in": 0, "rows_out": 0, "groups_out": 0, "files_out": 0}
    with storage_errors(job.output_url):
        exists = path is not None and out_fs.exists(path)
    if exists:
        with storage_errors(job.output_url), out_fs.open(path, "rb") as file:
            metadata = pq.read_metadata(file)
        counts.update(rows_out=metadata.num_rows, groups_out=_groups_of(metadata), files_out=1, skipped=1)
        for footer in read_footers(in_fs, shards):  # the counts in, from the footers only
            if isinstance(footer, Exception):
                raise footer
            counts["rows_in"] += footer.num_rows
            counts["groups_in"] += _groups_of(footer)
        return counts
    tables = []
    for shard in shards:
        table, out = transformed(job, shard, in_fs, duplicates.get(shard.name, set()))
        counts["rows_in"] += table.num_rows
        counts["groups_in"] += _groups_of(table)
        if out.num_rows:
            tables.append(out)
    if not tables:
        return counts
    merged = concat_shard_tables(tables)
    if job.export:
        output = export_table(job, merged)
        if output.num_rows == 0:
            return counts
        with storage_errors(job.output_url):
            if is_local(out_fs):
                out_fs.makedirs(posixpath.dirname(path), exist_ok=True)
            publish(out_fs, path, memoryview(_parquet_bytes(output)), join(out_base, TEMPORARY))
        counts.update(rows_out=output.num_rows, groups_out=output.num_rows, files_out=1)
        return counts
    metadata = {key: value for key, value in merged.schema.metadata.items() if key != METADATA_COMPACTED_FROM}
    metadata[METADATA_REPROCESSED_FROM] = json.dumps([shard.name for shard in shards]).encode()
    # A new id, stamped now that the bin is transformed (a rescore may take minutes): a run's
    # readers take a shard whose id is older than their clock less storage.index.GRACE_S as
    # consumed, and the input's ids may be days old.
    location = ShardLocation(shards[0].env, shards[0].policy_version, new_shard_id())
    with storage_errors(job.output_url):
        write_shard(
            out_fs,
            join(out_base, ROLLOUTS, location.name),
            merged.replace_schema_metadata(metadata),
            join(out_base, TEMPORARY),
            # its index entry just before the shard, as every writer does (storage.index)
            before=lambda: add_entry(out_fs, out_base, location),
        )
    counts.update(rows_out=merged.num_rows, groups_out=_groups_of(merged), files_out=1)
    return counts


def _groups_of(table_or_metadata: Any) -> int:
    metadata = (
        table_or_metadata.metadata
        if isinstance(table_or_metadata, pq.FileMetaData)
        else table_or_metadata.schema.metadata
    )
    value = (metadata or {}).get(METADATA_NUM_GROUPS)
    if value is not None:
        return int(value)
    return table_or_metadata.num_rows  # an export: one row per group


def _parquet_bytes(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def code_version() -> str:
    import subprocess
    from importlib.metadata import version
    from pathlib import Path

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    )
    return f"clotho {version('clotho')}" + (f" ({commit.stdout.strip()})" if commit.returncode == 0 else "")


def check_job(input_run_url: str, output_url: str, operations: list[str]) -> tuple[Job, Any, list[ShardInfo]]:
    """The job, the input's filesystem and shards, after every check that needs no full pass: the
    operations, both URLs, an input with shards, and the whole chain run on its first shard (bad
    columns, environments, tokenizers). Raises ReprocessError; writes nothing."""
    ops = plan_operations(operations)
    input_root, input_run = split_run_url(input_run_url)
    job = Job(input_run_url.rstrip("/"), output_url.rstrip("/"), ops)
    if not job.export:
        split_run_url(output_url)  # a run URL, or the error says what one looks like
    if job.output_url == job.input_run_url:
        raise ReprocessError(
            f"output {output_url} is the input: reprocessing never changes its input; give a new output"
        )
    in_fs, shards = find_shards(rollouts_url(input_root, input_run))
    if not shards:
        raise ReprocessError(f"input {input_run_url} holds no shards (looked in {rollouts_url(input_root, input_run)})")
    _, first = transformed(job, shards[0], in_fs, set())
    if job.export:
        export_table(job, first)
    return job, in_fs, shards


@flow(name="reprocess", task_runner=ThreadPoolTaskRunner(max_workers=os.cpu_count() or 2))
def reprocess(input_run_url: str, output_url: str, operations: list[str]) -> dict[str, Any]:
    """Apply `operations` to every shard of the run at `input_run_url`; write the result to
    `output_url` (a run, or a dataset directory for an export). Returns the lineage."""
    logger = get_run_logger()
    started = time.time()
    job, in_fs, shards = check_job(input_run_url, output_url, operations)
    ops, input_run = job.operations, split_run_url(job.input_run_url)[1]
    duplicates: dict[str, set[int]] = {}
    if ops[0].name == "dedupe":
        seen: set[bytes] = set()
        for shard in shards:  # in shard order: the first occurrence stays
            duplicates[shard.name] = duplicate_rows(read_shard(in_fs, shard), seen)
        logger.info("dedupe: %d duplicate sequences of %d shards", sum(map(len, duplicates.values())), len(shards))

    out_fs, out_base = resolve(job.output_url)
    description = {"inputs": [job.input_run_url], "operations": [op.describe() for op in ops]}
    job_path = join(out_base, JOB)
    with storage_errors(job.output_url):
        if out_fs.exists(job_path):
            earlier = json.loads(out_fs.cat_file(job_path))
            if earlier != description:
                raise ReprocessError(f"output {output_url} holds another job's output ({earlier}); give a new output")
            if not job.export and (
                dropped := drop_unpublished(out_fs, out_base, rollouts_url(*split_run_url(job.output_url)))
            ):  # a run killed mid-write
                logger.info("reprocess: %d index entries of shards an earlier run never wrote, removed", len(dropped))
        else:
            if is_local(out_fs):
                out_fs.makedirs(posixpath.dirname(job_path), exist_ok=True)
            out_fs.pipe_file(job_path, json.dumps(description).encode())

    work = bins(shards, ops)
    written = {} if job.export else written_bins(job)
    progress = create_progress_artifact(
        progress=0.0, key=artifact_key("reprocess-progress", input_run), description=f"{len(work)} output files"
    )
    futures = [
        process_bin.submit(
            job, shard_bin, {s.name: duplicates.get(s.name, set()) for s in shard_bin}, written.get(shard_bin[0].name)
        )
        for shard_bin in work
    ]
    totals: dict[str, int] = {}
    for done, future in enumerate(as_completed(futures), start=1):
        for key, value in future.result().items():
            totals[key] = totals.get(key, 0) + value
        if done % max(1, len(futures) // 20) == 0 or done == len(futures):
            update_progress_artifact(progress, 100.0 * done / len(futures))
            logger.info(
                "reprocess: %d/%d files, %d rows in, %d out", done, len(futures), totals["rows_in"], totals["rows_out"]
            )
    if totals.get("rows_out", 0) == 0:
        with storage_errors(job.output_url):
            out_fs.rm(job_path)
        raise ReprocessError(
            f"operations {[op.describe() for op in ops]} left no rows of {totals['rows_in']}: nothing was written"
        )
    lineage = {
        **description,
        "code_version": code_version(),
        "counts": totals,
        "seconds": round(time.time() - started, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with storage_errors(job.output_url):
        out_fs.pipe_file(join(out_base, LINEAGE), json.dumps(lineage, indent=1).encode())
    rows = "\n".join(f"| {key} | {value:,} |" for key, value in totals.items())
    create_markdown_artifact(
        key=artifact_key("reprocess", input_run),
        markdown=f"# reprocess {job.input_run_url} -> {job.output_url}\n\noperations: `{json.dumps(description['operations'])}`\n\n"
        f"{lineage['code_version']}\n\n| count | value |\n|---|---|\n{rows}\n",
        description="lineage of a reprocess job",
    )
    logger.info("reprocess done: %s", json.dumps(totals))
    return lineage

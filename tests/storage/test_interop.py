"""The rollouts directory is one Hive-partitioned dataset for DuckDB, Polars and pyarrow."""

from __future__ import annotations

import random

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds

from clotho.testing.groups import make_group
from storage.layout import rollouts_url
from storage.reader import ShardReader
from storage.writer import ShardWriter


def write_run(tmp_path) -> tuple[str, list]:
    rng = random.Random(31)
    groups = [
        make_group(rng, env=env, policy_version=v) for env in ("gsm8k", "chess") for v in (0, 3) for _ in range(3)
    ]
    with ShardWriter(str(tmp_path), "run", tokenizer="tok", max_groups=2) as writer:
        for group in groups:
            writer.add(group)
    # A quarantined shard and a leftover temp file must not leak into the dataset.
    truncated = ShardReader(str(tmp_path), "run").new_shards()[0]
    with open(truncated.path, "r+b") as file:
        file.truncate(100)
    list(ShardReader(str(tmp_path), "run").groups())
    (tmp_path / "run" / "_tmp").mkdir(exist_ok=True)
    (tmp_path / "run" / "_tmp" / ".leftover.parquet.tmp").write_bytes(b"half")
    kept = {g.group_id for g in ShardReader(str(tmp_path), "run").groups()}
    return rollouts_url(str(tmp_path), "run"), [g for g in groups if g.group_id in kept]


def expected_counts(groups: list) -> list[tuple[str, int, int]]:
    counts: dict = {}
    for group in groups:
        key = (group.env, group.policy_version)
        counts[key] = counts.get(key, 0) + len(group.sequences)
    return sorted((env, version, rows) for (env, version), rows in counts.items())


def test_duckdb_reads_the_shards_as_one_dataset(tmp_path) -> None:
    url, groups = write_run(tmp_path)
    rows = duckdb.sql(
        "SELECT env, policy_version, count(*) "
        f"FROM read_parquet('{url}/**/*.parquet', hive_partitioning=true) GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    assert rows == expected_counts(groups)
    tokens = duckdb.sql(f"SELECT sum(len(tokens)) FROM read_parquet('{url}/*/*/*.parquet')").fetchall()[0][0]
    assert tokens == sum(g.num_tokens for g in groups)


def test_polars_reads_the_shards_as_one_dataset(tmp_path) -> None:
    url, groups = write_run(tmp_path)
    frame = pl.scan_parquet(f"{url}/**/*.parquet", hive_partitioning=True).collect()
    counts = frame.group_by("env", "policy_version").len().sort("env", "policy_version").rows()
    assert counts == expected_counts(groups)
    assert frame["group_id"].n_unique() == len(groups)


def test_pyarrow_dataset_with_the_hive_partitioning(tmp_path) -> None:
    url, groups = write_run(tmp_path)
    partitioning = ds.partitioning(pa.schema([("env", pa.string()), ("policy_version", pa.int64())]), flavor="hive")
    table = ds.dataset(url, format="parquet", partitioning=partitioning).to_table()
    assert table.num_rows == sum(len(g.sequences) for g in groups)

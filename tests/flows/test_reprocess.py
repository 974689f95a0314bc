"""The reprocess flow and `clotho reprocess` against a real Prefect server: outputs a trainer reads,
lineage, idempotent reruns, a job killed half way, exports that load with `datasets` and train a
step, and bad input refused with one line and exit code 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from clotho.flow_runtime import drain_prefect_reporting
from core.scored_group import ScoredGroup, ScoredSequence
from flows.reprocess import reprocess
from storage.reader import ShardReader
from storage.schema import reprocessed_from
from storage.shard_file import find_shards, read_footers
from storage.writer import ShardWriter
from tests.flows.test_rollout_flow import api, flow_run_state

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def groups(count: int, seed: int = 0) -> list[ScoredGroup]:
    """Groups of 3 with scores i % 3 (one all-equal group in three), completions from the seed."""
    made = []
    for i in range(count):
        scores = [1.0, 0.0, 0.5] if i % 3 else [0.5, 0.5, 0.5]
        sequences = [
            ScoredSequence.from_prompt(
                [5, 6, 7],
                [10 + i, 20 + j + seed],
                [-0.5, -0.25],
                score=score,
                messages=[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{j}"}],
            )
            for j, score in enumerate(scores)
        ]
        made.append(ScoredGroup(env="toy", item_id=f"item-{i}", sequences=sequences))
    return made


@pytest.fixture
def source(tmp_path) -> str:
    with ShardWriter(f"file://{tmp_path}/in", "run", tokenizer="tok", max_groups=3) as writer:
        writer.add_many(groups(12))
    return f"file://{tmp_path}/in/run"


@pytest.fixture
def prefect(prefect_server):
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        yield prefect_server
        drain_prefect_reporting()  # while the server is still the one they report to


def output_rows(run_url: str) -> list[tuple[str, list[float]]]:
    root, run = run_url.rsplit("/", 1)
    return sorted((g.item_id, g.scores) for g in ShardReader(root, run).groups())  # shards in the order written


def sources(run_url: str) -> list[list[str]]:
    """The input shards each output shard of a run names in its metadata."""
    fs, shards = find_shards(run_url)
    return sorted(reprocessed_from(footer.metadata) for footer in read_footers(fs, shards))


def test_filter_then_advantages_writes_a_run_a_trainer_reads_with_lineage(source, tmp_path, prefect) -> None:
    out = f"file://{tmp_path}/out/run"
    operations = ["filter:drop_equal_scores=true", "advantages:mode=mean_only"]
    lineage = reprocess(input_run_url=source, output_url=out, operations=operations)
    assert lineage["counts"] | {"files_out": 0} == {
        "shards_in": 4,
        "rows_in": 36,
        "groups_in": 12,
        "rows_out": 24,
        "groups_out": 8,
        "files_out": 0,
    }
    root, run = out.rsplit("/", 1)
    stored = list(ShardReader(root, run).groups())
    assert sorted(g.item_id for g in stored) == sorted(f"item-{i}" for i in range(12) if i % 3)
    assert sources(out) == [[shard.name] for shard in sorted(find_shards(source)[1], key=lambda s: s.name)]
    assert all([s.advantages[-1] for s in g.sequences] == [0.5, -0.5, 0.0] for g in stored)
    written = json.loads(Path(tmp_path / "out" / "run" / "lineage.json").read_text())
    assert written["inputs"] == [source] and written["operations"][0] == {"op": "filter", "drop_equal_scores": True}
    assert written["code_version"].startswith("clotho ") and written["counts"] == lineage["counts"]
    assert len(find_shards(source)[1]) == 4  # the input is untouched

    again = reprocess(input_run_url=source, output_url=out, operations=operations)  # idempotent
    assert again["counts"]["rows_out"] == 24 and again["counts"]["skipped"] == 4
    assert len(output_rows(out)) == 8


def test_a_job_killed_half_way_and_run_again_ends_with_the_same_output(source, tmp_path, prefect) -> None:
    operations = ["dedupe", "filter:score_min=0.5"]
    whole, killed = f"file://{tmp_path}/whole/run", f"file://{tmp_path}/killed/run"
    reprocess(input_run_url=source, output_url=whole, operations=operations)
    # A kill leaves some output files (each one whole: published atomically) and no lineage.
    command = [sys.executable, "-m", "clotho.cli", "reprocess", source, killed, *operations]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**prefect.env(), "PYTHONUNBUFFERED": "1"},
    )
    for line in process.stdout:  # killed once the first output file is logged
        if "reprocess: 1/" in line or "files," in line:
            break
    process.kill()
    process.wait(timeout=30)
    reprocess(input_run_url=source, output_url=killed, operations=operations)
    assert sources(killed) == sources(whole) and output_rows(killed) == output_rows(whole)
    assert (tmp_path / "killed" / "run" / "lineage.json").exists()


def test_exports_load_with_datasets_and_train_a_step(source, tmp_path, prefect, tiny_model_dir) -> None:
    sft_dir, dpo_dir = tmp_path / "sft", tmp_path / "dpo"
    reprocess(
        input_run_url=source, output_url=f"file://{sft_dir}", operations=["export-sft:tokenizer=" + str(tiny_model_dir)]
    )
    reprocess(input_run_url=source, output_url=f"file://{dpo_dir}", operations=["export-dpo"])
    sft = datasets.load_dataset("parquet", data_files=str(sft_dir / "data" / "*.parquet"), split="train")
    dpo = datasets.load_dataset("parquet", data_files=str(dpo_dir / "data" / "*.parquet"), split="train")
    assert len(sft) == 12 and len(dpo) == 8 and "messages" in sft.column_names and "prompt" in sft.column_names
    assert sorted(sft["item_id"]) == sorted(f"item-{i}" for i in range(12))
    # The exported rows as the trainer's SFT and DPO groups, one step each objective.
    train = []
    for row in sft:
        train.append(
            ScoredGroup(
                env="sft",
                item_id=row["item_id"],
                objective="sft",
                sequences=[
                    ScoredSequence.from_prompt(
                        row["prompt_token_ids"],
                        row["completion_token_ids"],
                        [0.0] * len(row["completion_token_ids"]),
                        score=row["score"],
                    )
                ],
            )
        )
    for row in dpo:
        train.append(
            ScoredGroup(
                env="pairs",
                item_id=row["item_id"],
                objective="dpo",
                sequences=[
                    ScoredSequence.from_prompt(
                        row["prompt_token_ids"],
                        row[f"{side}_token_ids"],
                        [0.0] * len(row[f"{side}_token_ids"]),
                        score=row[f"{side}_score"],
                    )
                    for side in ("chosen", "rejected")
                ],
            )
        )
    with ShardWriter(f"file://{tmp_path}/train", "run", tokenizer=str(tiny_model_dir)) as writer:
        writer.add_many(train)
    command = [
        sys.executable,
        "-m",
        "trainer.cli",
        "--run",
        f"file://{tmp_path}/train/run",
        "--model",
        str(tiny_model_dir),
        "--steps",
        "1",
        "--set",
        f"groups_per_step={len(train)}",
        "--data-timeout-s",
        "60",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads((tmp_path / "train" / "run" / "trainer" / "metrics.jsonl").read_text().splitlines()[0])
    assert (
        metrics["groups"] == 20
        and "dpo/accuracy" in metrics
        and metrics.get("sft/loss", metrics.get("loss")) is not None
    )


@pytest.mark.parametrize(
    ("operations", "message"),
    [
        (["shuffle"], "operation 'shuffle': unknown"),
        (["filter:where=nope > 1"], "where 'nope > 1'"),
        (["filter:score_min=9"], "left no rows of 36: nothing was written"),
        (["rescore:env=compare,tokenizer=other"], "tokenizer 'other' is not the shards' ('tok')"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(source, tmp_path, prefect, operations, message) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "clotho.cli", "reprocess", source, f"file://{out}/run", *operations]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=prefect.env())
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("clotho reprocess:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert not list(out.rglob("*.parquet")) and not (out / "run" / "lineage.json").exists()


def test_the_scheduled_reprocess_deployment_runs_on_a_worker(source, tmp_path, prefect) -> None:
    prefect.cli("work-pool", "create", "reprocess-pool", "--type", "process", "--overwrite")
    prefect.cli("--no-prompt", "deploy", "--name", "reprocess-nightly", cwd=REPO)
    deployment = api(prefect, "GET", "/deployments/name/reprocess/reprocess-nightly").json()
    schedules = api(prefect, "GET", f"/deployments/{deployment['id']}/schedules").json()
    assert [s["schedule"]["cron"] for s in schedules] == ["0 3 * * *"]
    out = f"file://{tmp_path}/nightly/run"
    params = {"input_run_url": source, "output_url": out, "operations": ["filter:score_min=0.5"]}
    started = prefect.cli("deployment", "run", "reprocess/reprocess-nightly", "--params", json.dumps(params)).stdout
    flow_run_id = started.split("UUID:")[1].split()[0]
    prefect.cli("worker", "start", "--pool", "reprocess-pool", "--run-once", timeout=600)
    assert flow_run_state(prefect, flow_run_id) == "COMPLETED"
    assert len(output_rows(out)) == 12 and (tmp_path / "nightly" / "run" / "lineage.json").exists()


def test_evaluate_two_checkpoints_writes_two_results_with_their_versions(
    tmp_path, prefect, tiny_model_dir, policy_server
) -> None:
    from flows.evaluate import EvaluationError, evaluate, find_checkpoint
    from storage.checkpoints import mark_best, publish_checkpoint

    root = f"file://{tmp_path}/store"
    for step in (1, 2):
        publish_checkpoint(tiny_model_dir, root, "run", step)
    first = evaluate(
        env="compare", checkpoint=f"{root}/run/checkpoints/step-00000001", env_config={"max_value": 9}, items=4
    )
    latest = evaluate(env="compare", checkpoint="LATEST", run_url=f"{root}/run", env_config={"max_value": 9}, items=4)
    assert (first["step"], first["policy_version"], latest["step"], latest["policy_version"]) == (1, 1, 2, 2)
    for step, result in ((1, first), (2, latest)):
        written = json.loads(
            (tmp_path / "store" / "run" / "checkpoints" / f"step-{step:08d}" / "evaluation-compare.json").read_text()
        )
        assert written == result and written["report"]["items"] == 4
    assert (
        evaluate(env="compare", checkpoint="LATEST", run_url=f"{root}/run", env_config={"max_value": 9}, items=4)
        == latest
    )  # once
    # BEST: the step the run's evaluator marked best (checkpoints/BEST), none before it marked one.
    with pytest.raises(EvaluationError, match="has no best checkpoint: its pipeline marks one"):
        find_checkpoint("BEST", f"{root}/run")
    mark_best(root, "run", 1, 0.25)
    assert (
        evaluate(env="compare", checkpoint="BEST", run_url=f"{root}/run", env_config={"max_value": 9}, items=4) == first
    )
    # A running server must serve the checkpoint's version: the fixture's serves 0.
    command = [
        sys.executable,
        "-m",
        "clotho.cli",
        "evaluate",
        "--env",
        "compare",
        "--checkpoint",
        "LATEST",
        "--run",
        f"{root}/run",
        "--server",
        policy_server.base_url,
        "--force",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=prefect.env())
    assert done.returncode == 2 and "serves version 0, not 2" in done.stderr, done.stderr[-2000:]


def test_compact_merges_a_partitions_outputs(source, tmp_path, prefect) -> None:
    out = f"file://{tmp_path}/compacted/run"
    lineage = reprocess(input_run_url=source, output_url=out, operations=["advantages", "compact:target_mb=64"])
    shards = find_shards(out)[1]
    assert len(shards) == 1 and lineage["counts"]["files_out"] == 1 and lineage["counts"]["shards_in"] == 4
    root, run = out.rsplit("/", 1)
    in_order = [g.item_id for g in ShardReader(root, run).groups()]
    assert in_order == [f"item-{i}" for i in range(12)]  # every group, in the input's order

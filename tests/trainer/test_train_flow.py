"""The Prefect `train` flow under a real (temporary) Prefect server: trains, logs, makes artifacts."""

from __future__ import annotations

import pytest

from flows.train import sparkline, table_columns
from tests.trainer.rollouts import sampled_groups, write_shards


def test_sparkline_spans_the_range():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert len(sparkline([float(i) for i in range(1000)], width=60)) == 60


def test_table_columns_put_the_known_ones_first_then_whatever_was_logged():
    history = [{"step": 1, "my_metric": 0.5, "loss": 1.0}, {"step": 2, "loss": 0.5, "other": 2.0}]
    assert table_columns(history) == ["step", "loss", "my_metric", "other"]
    assert table_columns([]) == []


@pytest.mark.slow
@pytest.mark.integration
def test_flow_trains_and_reports(tmp_path, tiny_model_dir, in_process_trainer, prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from clotho.flow_runtime import drain_prefect_reporting
    from flows.train import train

    root = str(tmp_path)
    write_shards(root, "flow-run", sampled_groups(tiny_model_dir, 4, seed=40), groups_per_shard=4)
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        result = train(
            run_url=f"{root}/flow-run",
            model=str(tiny_model_dir),
            steps=2,
            overrides=["groups_per_step=2", "save_every=2", "lr=1e-3"],
            data_timeout_s=60,
        )
        with get_client(sync_client=True) as client:
            keys = {artifact.key for artifact in client.read_artifacts()}
        drain_prefect_reporting()  # while the server is still the one the logs go to
    assert result["steps"] == 2 and result["checkpoint"].endswith("step-00000002")
    assert {"loss", "score_mean", "tokens_per_s"} <= set(result["final_metrics"])
    assert {"train-flow-run-metrics", "train-flow-run-report", "train-flow-run-progress"} <= keys

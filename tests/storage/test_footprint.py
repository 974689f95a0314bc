"""A run's footprint: checkpoints kept and their bytes, shards' bytes."""

from __future__ import annotations

from storage.checkpoints import apply_retention, publish_checkpoint
from storage.footprint import run_footprint


def test_footprint_counts_kept_steps_and_the_largest(tmp_path):
    root = f"file://{tmp_path}/store"
    assert run_footprint(root, "run") == {
        "checkpoints": 0.0,
        "checkpoint_bytes": 0.0,
        "largest_checkpoint_bytes": 0.0,
        "shard_bytes": 0.0,
    }
    for step, size in ((1, 1000), (2, 300), (3, 300), (4, 5000)):
        local = tmp_path / f"local-{step}"
        local.mkdir()
        (local / "config.json").write_text("{}")
        (local / "model.safetensors").write_bytes(b"x" * size)
        publish_checkpoint(local, root, "run", step)
    shards = tmp_path / "store" / "run" / "rollouts" / "env=e" / "policy_version=0"
    shards.mkdir(parents=True)
    (shards / "a.parquet").write_bytes(b"y" * 70)
    apply_retention(root, "run", keep_last=2)
    footprint = run_footprint(root, "run")
    assert footprint["checkpoints"] == 2 and footprint["shard_bytes"] == 70
    assert 5300 < footprint["checkpoint_bytes"] < 5300 + 2 * 1000  # the two kept, STABLE manifests included
    assert 5000 < footprint["largest_checkpoint_bytes"] < 6000

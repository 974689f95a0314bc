"""Checkpoint discovery and retention on every backend: LATEST at constant cost, the last K plus
every N-th kept, never LATEST or a pinned step, and a deletion killed half way never looks published."""

from __future__ import annotations

import fsspec
import pytest

import storage.checkpoints as checkpoints
from storage.checkpoints import (
    CheckpointError,
    CheckpointInfo,
    apply_retention,
    best_checkpoint,
    latest_checkpoint,
    mark_best,
    pin_steps,
    publish_checkpoint,
    published_steps,
    read_checkpoint,
    retained,
)
from storage.filesystem import resolve


@pytest.fixture
def model_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights" * 10)
    return model


def publish(root: str, model_dir, steps) -> None:
    for step in steps:
        publish_checkpoint(model_dir, root, "run", step)


def test_latest_reads_the_pointer_and_looks_one_step_past_it(root: str, model_dir, monkeypatch) -> None:
    assert latest_checkpoint(root, "run") is None
    publish(root, model_dir, range(1, 6))
    fs, path = fsspec.core.url_to_fs(f"{root}/run/checkpoints")
    fs.pipe_file(f"{path}/LATEST", b"step-00000004")  # a trainer killed between STABLE and LATEST
    monkeypatch.setattr(checkpoints, "step_directories", lambda *a, **k: pytest.fail("listed the steps"))
    assert latest_checkpoint(root, "run").step == 5
    monkeypatch.undo()
    fs.rm(f"{path}/LATEST")
    assert latest_checkpoint(root, "run").step == 5  # no pointer: the steps are listed


def test_a_checkpoint_names_its_run(root: str, model_dir, tmp_path) -> None:
    publish(root, model_dir, [3])
    assert latest_checkpoint(root, "run").run_url == f"{root}/run"
    elsewhere = CheckpointInfo(url=f"file://{tmp_path}/loose/step-00000003", step=3, manifest={})
    with pytest.raises(CheckpointError, match="not in a run's checkpoints/ directory"):
        _ = elsewhere.run_url


def test_retention_keeps_the_last_k_every_nth_latest_and_pinned(root: str, model_dir) -> None:
    assert retained(list(range(1, 11)), 3, 4) == {4, 8, 9, 10}
    publish(root, model_dir, range(1, 11))
    pin_steps(root, "run", "http://127.0.0.1:8000", {2})  # a server still serves step 2
    deleted = apply_retention(root, "run", keep_last=3, keep_every=4)
    assert deleted == [1, 3, 5, 6, 7]
    assert published_steps(root, "run") == [2, 4, 8, 9, 10]
    fs, path = fsspec.core.url_to_fs(f"{root}/run/checkpoints")
    assert not fs.exists(f"{path}/step-00000001")
    pin_steps(root, "run", "http://127.0.0.1:8000", set())  # it moved on
    assert apply_retention(root, "run", keep_last=1) == [2, 4, 8, 9]
    assert latest_checkpoint(root, "run").step == 10
    with pytest.raises(ValueError, match="keep at least the newest step"):
        apply_retention(root, "run", keep_last=0)


def test_retention_keeps_the_last_steps_whatever_the_resume_state(root: str, model_dir) -> None:
    # A trainer resumed from an older state trains deleted steps again without publishing them
    # (tests/trainer/test_train.py: a resumed trainer never takes LATEST back).
    publish(root, model_dir, range(1, 11))
    assert apply_retention(root, "run", keep_last=2) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert published_steps(root, "run") == [9, 10]


def test_a_step_pinned_during_its_deletion_is_put_back(root: str, model_dir, monkeypatch) -> None:
    publish(root, model_dir, range(1, 4))
    real = checkpoints.pinned_steps
    calls = []

    def pinned_after_the_first_look(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs) if len(calls) == 1 else {1}  # a watcher pinned 1 meanwhile

    monkeypatch.setattr(checkpoints, "pinned_steps", pinned_after_the_first_look)
    assert apply_retention(root, "run", keep_last=1) == [2]
    assert read_checkpoint(f"{root}/run/checkpoints/step-00000001").step == 1  # whole, STABLE again


def test_the_best_step_is_never_removed_by_retention(root: str, model_dir) -> None:
    publish(root, model_dir, range(1, 7))
    assert best_checkpoint(root, "run") is None
    assert mark_best(root, "run", 2, 0.857)
    assert apply_retention(root, "run", keep_last=2) == [1, 3, 4]
    info = best_checkpoint(root, "run")
    assert (info.step, checkpoints.read_best(root, "run")["reward"]) == (2, 0.857)
    assert mark_best(root, "run", 6, 0.9)  # a better one: the old best goes with the next pass
    publish(root, model_dir, [7, 8])
    assert apply_retention(root, "run", keep_last=2) == [2, 5]
    assert published_steps(root, "run") == [6, 7, 8] and best_checkpoint(root, "run").step == 6


def test_a_step_deleted_before_it_is_marked_best_is_not_named(root: str, model_dir) -> None:
    publish(root, model_dir, range(1, 5))
    assert mark_best(root, "run", 2, 0.5)
    apply_retention(root, "run", keep_last=1)  # 1 and 3 go; 2 is best
    assert not mark_best(root, "run", 3, 0.7)  # the evaluator was too late: BEST still names 2
    assert best_checkpoint(root, "run").step == 2


def test_a_step_marked_best_during_its_deletion_is_put_back(root: str, model_dir, monkeypatch) -> None:
    publish(root, model_dir, range(1, 4))
    real = checkpoints.read_best
    calls = []

    def marked_after_the_first_look(*args, **kwargs):
        calls.append(1)
        return (
            real(*args, **kwargs) if len(calls) == 1 else {"step": 1, "reward": 1.0}
        )  # the evaluator marked 1 meanwhile

    monkeypatch.setattr(checkpoints, "read_best", marked_after_the_first_look)
    assert apply_retention(root, "run", keep_last=1) == [2]
    assert read_checkpoint(f"{root}/run/checkpoints/step-00000001").step == 1  # whole, STABLE again


def test_a_deletion_killed_half_way_leaves_no_published_looking_step(root: str, model_dir, monkeypatch) -> None:
    publish(root, model_dir, range(1, 4))
    fs, _ = resolve(root)  # the instance storage uses too (fsspec caches them)
    real_rm = fs.rm

    def killed_after_stable(path, *args, **kwargs):
        if kwargs.get("recursive"):
            raise KeyboardInterrupt  # killed between removing STABLE and the files
        return real_rm(path, *args, **kwargs)

    monkeypatch.setattr(fs, "rm", killed_after_stable)
    with pytest.raises(KeyboardInterrupt):
        apply_retention(root, "run", keep_last=1)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="no STABLE"):
        read_checkpoint(f"{root}/run/checkpoints/step-00000001")
    assert published_steps(root, "run") == [2, 3]
    assert latest_checkpoint(root, "run").step == 3
    assert apply_retention(root, "run", keep_last=1) == [2]  # and the next pass clears the rest
    _, path = fsspec.core.url_to_fs(f"{root}/run/checkpoints")
    assert not fs.exists(f"{path}/step-00000001")

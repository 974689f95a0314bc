"""Reload preflight and preparation without a server: tensor checks, tied heads, run URLs, reports."""

import asyncio
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from clotho.testing.reloading import perturbed_checkpoint
from inference.parity_guard import ParityGuard, ParityReport, tolerance_for
from inference.reload import ReloadError, ServedPolicy, restore_server
from inference.server import free_port
from inference.watcher import split_run_url
from inference.weights import (
    HEAD,
    INDEX_FILE,
    IncompatibleCheckpoint,
    check_compatible,
    config_differences,
    prepare_reload_dir,
    tensor_shapes,
)
from tests.conftest import cached_tiny_model


@pytest.fixture(scope="module")
def untied():
    return cached_tiny_model()


@pytest.fixture(scope="module")
def tied():
    return cached_tiny_model(tie_embeddings=True)


def test_tensor_shapes_reads_headers_only(untied):
    shapes = tensor_shapes(untied)
    assert shapes["model.embed_tokens.weight"] == (512, 128)
    assert shapes[HEAD] == (512, 128)
    assert len(shapes) == len(load_file(untied / "model.safetensors"))


def test_compatible_checkpoint_passes(untied, tmp_path):
    check_compatible(perturbed_checkpoint(untied, tmp_path / "new", seed=1), untied)


def test_missing_tensor_is_named(untied, tmp_path):
    broken = perturbed_checkpoint(untied, tmp_path / "new", seed=1, drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(IncompatibleCheckpoint, match=r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight"):
        check_compatible(broken, untied)


def test_reshaped_and_unexpected_tensors_are_named(untied, tmp_path):
    out = perturbed_checkpoint(untied, tmp_path / "new", seed=1)
    tensors = load_file(out / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(64)
    tensors["extra.bias"] = torch.zeros(3)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(IncompatibleCheckpoint, match=r"unexpected tensors extra\.bias.*model\.norm\.weight \(64,\)"):
        check_compatible(out, untied)


def test_truncated_file_is_rejected(untied, tmp_path):
    out = perturbed_checkpoint(untied, tmp_path / "new", seed=1)
    (out / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:6])
    with pytest.raises(IncompatibleCheckpoint, match="not a safetensors file"):
        check_compatible(out, untied)


def test_tied_head_is_optional_in_a_tied_checkpoint(tied, tmp_path):
    with_head = perturbed_checkpoint(tied, tmp_path / "new", seed=1)
    tensors = load_file(with_head / "model.safetensors")
    save_file({**tensors, HEAD: tensors["model.embed_tokens.weight"].clone()}, with_head / "model.safetensors")
    check_compatible(with_head, tied)
    check_compatible(tied, with_head)


def test_untied_checkpoint_is_its_own_reload_dir(untied, tmp_path):
    assert prepare_reload_dir(untied, tmp_path / "reload") == untied


def test_tied_reload_dir_adds_the_head(tied, tmp_path):
    checkpoint = perturbed_checkpoint(tied, tmp_path / "new", seed=1)
    assert HEAD not in tensor_shapes(checkpoint)
    reload_dir = prepare_reload_dir(checkpoint, tmp_path / "reload")
    assert reload_dir != checkpoint and prepare_reload_dir(checkpoint, tmp_path / "reload") == reload_dir
    with safe_open(reload_dir / "clotho-tied-lm-head.safetensors", framework="pt") as head:
        embedding = load_file(checkpoint / "model.safetensors")["model.embed_tokens.weight"]
        assert torch.equal(head.get_tensor(HEAD), embedding)
    assert (reload_dir / "config.json").resolve() == (checkpoint / "config.json").resolve()
    assert set(tensor_shapes(reload_dir)) == set(tensor_shapes(checkpoint)) | {HEAD}


def test_tied_reload_dir_lists_the_head_in_a_sharded_index(tied, tmp_path):
    checkpoint = perturbed_checkpoint(tied, tmp_path / "new", seed=1)
    names = load_file(checkpoint / "model.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    (checkpoint / INDEX_FILE).write_text(json.dumps(index))
    reload_dir = prepare_reload_dir(checkpoint, tmp_path / "reload")
    index = json.loads((reload_dir / INDEX_FILE).read_text())
    assert index["weight_map"][HEAD] == "clotho-tied-lm-head.safetensors"
    assert json.loads((checkpoint / INDEX_FILE).read_text())["weight_map"].get(HEAD) is None


def test_config_differences_ignore_save_noise(untied, tmp_path):
    changed = perturbed_checkpoint(
        untied, tmp_path / "new", seed=1, config_changes={"rms_norm_eps": 0.01, "transformers_version": "9"}
    )
    assert config_differences(changed, untied) == ["rms_norm_eps: 1e-06 -> 0.01"]


@pytest.mark.parametrize(
    "url, expected",
    [
        ("file:///data/runs/myrun", ("file:///data/runs", "myrun")),
        ("s3://bucket/prefix/myrun/", ("s3://bucket/prefix", "myrun")),
        ("/local/runs/r1", ("/local/runs", "r1")),
    ],
)
def test_split_run_url(url, expected):
    assert split_run_url(url) == expected


@pytest.mark.parametrize("url", ["myrun", "s3://myrun", "file:///", "s3://bucket/bad name"])
def test_split_run_url_rejects_urls_without_a_run(url):
    with pytest.raises(ValueError, match="STORAGE_URL/RUN|run name"):
        split_run_url(url)


def test_parity_report_fails_on_nan_and_unknown_dtype_is_named():
    assert not ParityReport("x", float("nan"), 1e-4, 8, 0.1).passed
    assert ParityReport("x", 5e-5, 1e-4, 8, 0.1).passed
    with pytest.raises(ValueError, match="float64"):
        tolerance_for("float64")


def test_restore_that_cannot_work_is_a_clear_error(tmp_path):
    guard = ParityGuard([[1, 2, 3]])
    dead = ServedPolicy(f"http://127.0.0.1:{free_port()}", tmp_path, 3)
    with pytest.raises(ReloadError, match="could not be restored to version 3.*restart it on"):
        asyncio.run(restore_server(dead, guard, tmp_path / "reload"))
    assert not dead.healthy


def test_check_watch_names_the_fix_before_a_server_starts(untied):
    from inference.cli import check_watch

    check_watch(untied, "file:///data/runs/myrun")
    with pytest.raises(ValueError, match="local model directory"):
        check_watch("Qwen/Qwen2.5-0.5B", "file:///data/runs/myrun")
    with pytest.raises(ValueError, match="STORAGE_URL/RUN"):
        check_watch(untied, "s3://bucket")

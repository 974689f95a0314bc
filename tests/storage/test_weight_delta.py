"""Weights published as deltas: rebuilt byte for byte from a full step and the deltas after it, on
every backend; a torn or foreign delta and a missing step of a chain never give weights; retention
keeps every step a kept one is built from."""

from __future__ import annotations

import json
import shutil

import fsspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from storage.checkpoints import (
    SPARE_WEIGHTS,
    CheckpointError,
    apply_retention,
    checkpoint_url,
    drop_cached_copy,
    fetch_checkpoint,
    pin_steps,
    publish_checkpoint,
    published_steps,
    read_checkpoint,
)
from storage.weight_delta import DELTA_FILE, WEIGHTS_FILE, DeltaError, apply, encode
from trainer.publishing import raw_bytes


def weights_at(step: int) -> dict[str, torch.Tensor]:
    """bf16 weights that move a little each step, as at a small learning rate: a few values change."""
    generator = torch.Generator().manual_seed(0)
    base = {"a.weight": torch.randn(64, 48, generator=generator), "b.bias": torch.randn(7, generator=generator)}
    moved = {}
    for name, tensor in base.items():
        noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(step)) * 1e-3 * step
        moved[name] = (tensor + noise).to(torch.bfloat16).contiguous()
    return moved


def delta(step: int, base: int) -> bytes:
    now = {name: ("bfloat16", tuple(t.shape), raw_bytes(t)) for name, t in weights_at(step).items()}
    return encode(now, {name: raw_bytes(t) for name, t in weights_at(base).items()}, base)


def full_file(step: int, path) -> bytes:
    save_file(weights_at(step), path, metadata={"format": "pt"})
    return path.read_bytes()


def test_deltas_rebuild_the_full_file_byte_for_byte(tmp_path) -> None:
    full_file(1, tmp_path / "base.safetensors")
    expected = full_file(4, tmp_path / "expected.safetensors")
    apply(
        tmp_path / "base.safetensors",
        [(2, delta(2, 1)), (3, delta(3, 2)), (4, delta(4, 3))],
        tmp_path / "out.safetensors",
    )
    assert (tmp_path / "out.safetensors").read_bytes() == expected
    assert len(delta(2, 1)) < 0.5 * len(expected)


def test_a_delta_on_other_weights_or_corrupt_fails_its_checksum(tmp_path) -> None:
    full_file(1, tmp_path / "base.safetensors")
    with pytest.raises(DeltaError, match="checksum"):
        apply(tmp_path / "base.safetensors", [(3, delta(3, 2))], tmp_path / "out.safetensors")  # step 2 skipped
    body = bytearray(delta(2, 1))
    body[-3] ^= 0xFF  # a flipped byte in the last tensor's compressed XOR
    with pytest.raises(DeltaError, match="b.bias"):
        apply(tmp_path / "base.safetensors", [(2, bytes(body))], tmp_path / "out.safetensors")
    with pytest.raises(DeltaError, match="not a weight delta"):
        apply(tmp_path / "base.safetensors", [(2, b"junk")], tmp_path / "out.safetensors")


def test_a_failed_apply_closes_every_file_it_opened(tmp_path) -> None:
    import os

    full_file(1, tmp_path / "base.safetensors")
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError):  # the file to write cannot be made: the base is open already
        apply(tmp_path / "base.safetensors", [(2, delta(2, 1))], tmp_path / "no-such-dir" / "out.safetensors")
    with pytest.raises(DeltaError, match="checksum"):  # both open when a chunk fails
        apply(tmp_path / "base.safetensors", [(3, delta(3, 2))], tmp_path / "out.safetensors")
    assert len(os.listdir("/proc/self/fd")) == before


def publish_chain(root: str, tmp_path, fulls: set[int], steps: range, run: str = "run", shift: int = 0) -> None:
    """Steps published as the trainer does: full ones in `fulls`, the others deltas on the one before
    (step N holds weights_at(N + shift))."""
    chain: list[int] = []
    for step in steps:
        source = tmp_path / f"{run}-source-{step}"
        source.mkdir(parents=True)
        (source / "config.json").write_text("{}")
        extra = {}
        if step in fulls:
            full_file(step + shift, source / WEIGHTS_FILE)
            chain = [step]
        else:
            (source / DELTA_FILE).write_bytes(delta(step + shift, chain[-1] + shift))
            extra = {"delta": {"chain": list(chain)}}
            chain.append(step)
        publish_checkpoint(source, root, run, step, extra=extra)


def test_a_delta_step_is_fetched_as_full_weights_from_its_chain(root: str, tmp_path) -> None:
    publish_chain(root, tmp_path, {1}, range(1, 5))
    cache = tmp_path / "cache"
    local = fetch_checkpoint(read_checkpoint(checkpoint_url(root, "run", 3)), cache)
    assert local == cache / "step-00000003" and (local / "config.json").exists() and not (local / DELTA_FILE).exists()
    assert (local / WEIGHTS_FILE).read_bytes() == full_file(3, tmp_path / "expected-3")
    assert json.loads((local / "STABLE").read_text())["delta"]["chain"] == [1, 2]
    # Step 4 starts from the rebuilt step 3 in the cache: the full step is not read again.
    fs, path = fsspec.core.url_to_fs(checkpoint_url(root, "run", 1))
    fs.rm(f"{path}/{WEIGHTS_FILE}")
    local = fetch_checkpoint(read_checkpoint(checkpoint_url(root, "run", 4)), cache)
    assert load_file(local / WEIGHTS_FILE)["a.weight"].equal(weights_at(4)["a.weight"])


def test_a_torn_delta_or_a_missing_step_of_the_chain_gives_no_weights(root: str, tmp_path) -> None:
    publish_chain(root, tmp_path, {1}, range(1, 4))
    fs, path = fsspec.core.url_to_fs(checkpoint_url(root, "run", 3))
    body = bytearray(fs.cat_file(f"{path}/{DELTA_FILE}"))
    body[-2] ^= 0x55  # same size: STABLE's sizes cannot tell
    fs.pipe_file(f"{path}/{DELTA_FILE}", bytes(body))
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError, match="step-00000003.*b.bias"):
        fetch_checkpoint(read_checkpoint(checkpoint_url(root, "run", 3)), cache)
    assert not (cache / "step-00000003").exists()
    fs, first = fsspec.core.url_to_fs(checkpoint_url(root, "run", 1))
    fs.rm(first, recursive=True)
    with pytest.raises(CheckpointError, match=r"a delta on steps \[1, 2\].*gone"):
        fetch_checkpoint(read_checkpoint(checkpoint_url(root, "run", 3)), tmp_path / "other-cache")


def test_a_rebuild_writes_over_the_weights_file_of_a_dropped_copy(root: str, tmp_path) -> None:
    """A copy no one serves leaves its weights file as the cache's spare; the next rebuild writes
    its weights into that file (moved, its pages reused), of whatever size it was, byte for byte."""
    publish_chain(root, tmp_path, {1}, range(1, 5))
    cache = tmp_path / "cache"
    for step in (2, 3):
        fetch_checkpoint(read_checkpoint(checkpoint_url(root, "run", step)), cache)
    with (cache / "step-00000002" / WEIGHTS_FILE).open("ab") as longer:
        longer.write(b"\0" * 1000)  # a spare longer than the weights: cut to their length
    inode = (cache / "step-00000002" / WEIGHTS_FILE).stat().st_ino
    drop_cached_copy(cache / "step-00000002")
    assert not (cache / "step-00000002").exists() and (cache / SPARE_WEIGHTS).stat().st_ino == inode
    local = fetch_checkpoint(read_checkpoint(checkpoint_url(root, "run", 4)), cache)
    assert (local / WEIGHTS_FILE).stat().st_ino == inode and not (cache / SPARE_WEIGHTS).exists()
    assert (local / WEIGHTS_FILE).read_bytes() == full_file(4, tmp_path / "expected-4")
    # No spare: a new file, the same bytes.
    shutil.rmtree(local)
    local = fetch_checkpoint(read_checkpoint(checkpoint_url(root, "run", 4)), cache)
    assert (local / WEIGHTS_FILE).read_bytes() == full_file(4, tmp_path / "expected-4")


def test_retention_keeps_the_chain_of_every_step_it_keeps(root: str, tmp_path) -> None:
    publish_chain(root, tmp_path, {1, 6}, range(1, 9))  # 1 full, 2-5 deltas, 6 full, 7-8 deltas
    assert apply_retention(root, "run", keep_last=1) == [1, 2, 3, 4, 5]
    assert published_steps(root, "run") == [6, 7, 8]
    publish_chain(root, tmp_path / "again", {9, 12}, range(9, 13))
    pin_steps(root, "run", "http://127.0.0.1:8000", {8})  # a server still serves step 8: its chain stays
    assert apply_retention(root, "run", keep_last=1) == [9, 10, 11]
    assert published_steps(root, "run") == [6, 7, 8, 12]


def test_a_cache_shared_by_two_runs_gives_each_its_own_weights(root: str, tmp_path) -> None:
    # Cached copies are named by step: run b's step 3 must not be run a's, nor built on it.
    publish_chain(root, tmp_path, {1}, range(1, 4), run="a")
    publish_chain(root, tmp_path, {1}, range(1, 4), run="b", shift=50)
    cache = tmp_path / "cache"
    for run, shift in (("a", 0), ("b", 50), ("a", 0)):
        local = fetch_checkpoint(read_checkpoint(checkpoint_url(root, run, 3)), cache)
        assert (local / WEIGHTS_FILE).read_bytes() == full_file(3 + shift, tmp_path / f"expected-{run}")


def test_after_a_delta_too_big_the_next_publishes_go_full_untried(monkeypatch, tmp_path) -> None:
    """Weights that all move (fp32 at a large learning rate) make a delta as big as the weights: the
    trainer publishes that step full and does not spend an XOR and a compression on the next
    full_every - 1 either; then it tries again, and its delta rebuilds the step from the one before.
    Every publish is cast into the one file the publisher keeps, written over in place."""
    import os
    from types import SimpleNamespace

    from storage import weight_delta
    from trainer.publishing import DeltaPublisher, published_tensors

    tried = []
    monkeypatch.setattr(weight_delta, "encode", lambda *args, **kw: tried.append(args[2]) or encode(*args, **kw))
    module = SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=False))
    publisher = DeltaPublisher(full_every=4, directory=tmp_path)

    def publishing(weights):
        return publisher.publishing(published_tensors(module, weights, None))

    def kept() -> dict[str, bytes]:
        return {name: os.pread(region.file, region.nbytes, region.offset) for name, region in publisher.kept.items()}

    assert publishing(weights_at(1)) is None  # nothing to take a delta against
    publisher.published(1, [])
    noisy = {
        name: torch.randn(t.shape, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        for name, t in weights_at(2).items()
    }
    assert publishing(noisy) is None and tried == [1]  # too big: step 2 goes full
    assert kept() == {name: raw_bytes(t).tobytes() for name, t in noisy.items()}
    publisher.published(2, [])
    for step in (3, 4, 5):
        assert publishing(weights_at(step)) is None  # full, untried
        publisher.published(step, [])
    assert tried == [1]
    full_file(5, tmp_path / "five.safetensors")
    first = publisher.file
    delta, chain = publishing(weights_at(6))  # tried again: a delta
    assert tried == [1, 5] and chain == [5] and publisher.file is first
    assert kept() == {name: raw_bytes(t).tobytes() for name, t in weights_at(6).items()}
    apply(tmp_path / "five.safetensors", [(6, delta)], tmp_path / "six.safetensors")
    assert (tmp_path / "six.safetensors").read_bytes() == full_file(6, tmp_path / "expected.safetensors")


def test_tensors_of_many_chunks_rebuild_and_a_wrong_chunk_is_named(tmp_path, monkeypatch) -> None:
    """A tensor is XORed, compressed and checked a chunk at a time (CHUNK bytes; 4 MiB in use):
    tensors of several chunks, a last one shorter, rebuild byte for byte, and a chunk applied to
    other bytes fails its own checksum."""
    from storage import weight_delta

    monkeypatch.setattr(weight_delta, "CHUNK", 1000)  # a.weight's 6144 bytes: 7 chunks, the last of 144
    full_file(1, tmp_path / "base.safetensors")
    expected = full_file(3, tmp_path / "expected.safetensors")
    two, three = delta(2, 1), delta(3, 2)
    header = json.loads(two[8 : 8 + int.from_bytes(two[:8], "little")])
    assert len(header["tensors"]["a.weight"]["chunks"]) == 7 and header["chunk"] == 1000
    apply(tmp_path / "base.safetensors", [(2, two), (3, three)], tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == expected
    with pytest.raises(DeltaError, match="a.weight rebuilt for step 3 fails its checksum"):
        apply(tmp_path / "base.safetensors", [(3, three)], tmp_path / "out.safetensors")


def test_a_streamed_safetensors_file_loads_as_safetensors_own_with_tied_tensors(tmp_path) -> None:
    from storage.weight_delta import safetensors_header, write_safetensors
    from trainer.publishing import SAFETENSORS_DTYPES

    tensors = {
        **weights_at(1),
        "c.fp32": torch.randn(3, 5),
        "d.ids": torch.arange(5),
        "e.mask": torch.tensor([True, False, True]),
    }
    tensors["tied"] = tensors["a.weight"]  # an lm_head tied to its embedding: written twice, no copy made
    write_safetensors(
        {n: (SAFETENSORS_DTYPES[t.dtype], tuple(t.shape), raw_bytes(t)) for n, t in tensors.items()},
        tmp_path / "w.safetensors",
        metadata={"format": "pt"},
    )
    loaded = load_file(tmp_path / "w.safetensors")
    assert loaded.keys() == tensors.keys()
    assert all(loaded[n].dtype == t.dtype and torch.equal(loaded[n], t) for n, t in tensors.items())
    raw, _ = safetensors_header(tmp_path / "w.safetensors")
    assert len(raw) % 8 == 0 and json.loads(raw[8:])["__metadata__"] == {"format": "pt"}  # tensors 8-aligned
    # Read as a rebuild reads a base (its header and offsets): copied byte for byte.
    apply(tmp_path / "w.safetensors", [], tmp_path / "copy.safetensors")
    assert (tmp_path / "copy.safetensors").read_bytes() == (tmp_path / "w.safetensors").read_bytes()


def test_a_tensor_named_twice_is_encoded_once_and_rebuilt_under_both_names(tmp_path, monkeypatch) -> None:
    """A tied head (the embedding's tensor under a second name) goes into a delta as `same_as`, not
    as a second XOR: the rebuild writes its bytes at both names, byte for byte the full file; a chain
    whose deltas tie other names together gives no weights."""
    from storage import weight_delta
    from storage.weight_delta import write_safetensors
    from trainer.publishing import SAFETENSORS_DTYPES

    monkeypatch.setattr(weight_delta, "CHUNK", 1000)  # several chunks: each is written at both places

    def tied(step: int) -> dict[str, torch.Tensor]:
        tensors = weights_at(step)
        return {"a.weight": tensors["a.weight"], "b.bias": tensors["b.bias"], "head": tensors["a.weight"]}

    def entries(tensors: dict[str, torch.Tensor]) -> dict:
        return {n: (SAFETENSORS_DTYPES[t.dtype], tuple(t.shape), raw_bytes(t)) for n, t in tensors.items()}

    def tied_delta(step: int, base: int) -> bytes:
        return encode(entries(tied(step)), {n: raw_bytes(t) for n, t in tied(base).items()}, base)

    write_safetensors(entries(tied(1)), tmp_path / "base.safetensors")
    write_safetensors(entries(tied(3)), tmp_path / "expected.safetensors")
    two = tied_delta(2, 1)
    header = json.loads(two[8 : 8 + int.from_bytes(two[:8], "little")])
    assert header["tensors"]["head"] == {"dtype": "BF16", "shape": [64, 48], "size": 6144, "same_as": "a.weight"}
    untied = {**tied(2), "head": tied(2)["head"].clone()}  # the same values in memory of their own
    assert len(two) < len(encode(entries(untied), {n: raw_bytes(t) for n, t in tied(1).items()}, 1))
    apply(tmp_path / "base.safetensors", [(2, two), (3, tied_delta(3, 2))], tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "expected.safetensors").read_bytes()
    other = encode(entries(untied), {n: raw_bytes(t) for n, t in tied(1).items()}, 1)
    with pytest.raises(DeltaError, match="the delta of step 3 ties other tensors together"):
        apply(tmp_path / "base.safetensors", [(2, other), (3, tied_delta(3, 2))], tmp_path / "out.safetensors")


def test_a_local_publish_links_the_staged_files_instead_of_copying_them(tmp_path) -> None:
    staged = tmp_path / "staging" / "step"
    staged.mkdir(parents=True)
    (staged / "config.json").write_text("{}")
    full_file(1, staged / WEIGHTS_FILE)
    storage = str(tmp_path / "store")
    leftover = tmp_path / "store" / "run" / "checkpoints" / "step-00000001"
    leftover.mkdir(parents=True)
    (leftover / WEIGHTS_FILE).write_bytes(b"torn by a killed publish")
    info = publish_checkpoint(staged, storage, "run", 1)
    published = leftover / WEIGHTS_FILE
    assert published.stat().st_ino == (staged / WEIGHTS_FILE).stat().st_ino  # one file, two names
    assert info.manifest["files"][WEIGHTS_FILE] == published.stat().st_size
    shutil.rmtree(tmp_path / "staging")  # the trainer drops its staging copy: the published file stays
    assert load_file(published).keys() == weights_at(1).keys()


def test_an_in_place_delta_writes_into_regions_only() -> None:
    """`in_place` writes each chunk back into the publisher's file; given tensors in memory it says
    so instead of leaving them as they were."""
    now = {name: ("bfloat16", tuple(t.shape), raw_bytes(t)) for name, t in weights_at(2).items()}
    with pytest.raises(TypeError, match="Regions"):
        encode(now, {name: raw_bytes(t) for name, t in weights_at(1).items()}, 1, in_place=True)

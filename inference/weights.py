"""Checks a checkpoint against the served weights and prepares it for vLLM's in-place reload."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from storage.weight_delta import safetensors_header

INDEX_FILE = "model.safetensors.index.json"
TIED_HEAD_FILE = "clotho-tied-lm-head.safetensors"
# The names Llama, Qwen2/2.5/3 and Mistral checkpoints use for the pair that tie_word_embeddings shares.
HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
# Fields every save rewrites; a difference there says nothing about the model.
_CONFIG_NOISE = {"_name_or_path", "transformers_version", "dtype", "torch_dtype"}


class IncompatibleCheckpoint(ValueError):
    """The checkpoint's tensors do not match the served model's: in-place reload would mix weights."""


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: a checkpoint directory needs its config.json") from None


def is_tied(model_dir: str | Path) -> bool:
    return bool(read_config(model_dir).get("tie_word_embeddings", False))


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files vLLM loads: those the index names, else every *.safetensors."""
    directory = Path(model_dir)
    index = directory / INDEX_FILE
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{directory} has no *.safetensors files; save checkpoints with safe_serialization=True"
        )
    return files


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's header (name -> dtype, shape, offsets), read without loading any tensor."""
    return safetensors_header(path, IncompatibleCheckpoint)[1]


def tensor_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name in the checkpoint with its shape."""
    return {
        name: tuple(entry["shape"]) for path in weight_files(model_dir) for name, entry in read_header(path).items()
    }


def check_compatible(checkpoint_dir: str | Path, served_dir: str | Path) -> None:
    """Raises IncompatibleCheckpoint unless the checkpoint has exactly the served model's tensors and shapes.

    vLLM's in-place reload does not fail on a missing tensor: it warns and keeps (or half-replaces)
    that layer's old weights, so the check has to happen before the server is touched.
    """
    new, served = tensor_shapes(checkpoint_dir), tensor_shapes(served_dir)
    if is_tied(served_dir):  # a tied head may or may not be written out; it is the embedding either way
        new.pop(HEAD, None)
        served.pop(HEAD, None)
    missing = sorted(served.keys() - new.keys())
    unexpected = sorted(new.keys() - served.keys())
    reshaped = sorted(
        f"{name} {new[name]} (served {served[name]})"
        for name in new.keys() & served.keys()
        if new[name] != served[name]
    )
    problems = [
        f"missing tensors {_few(missing)}" if missing else "",
        f"unexpected tensors {_few(unexpected)}" if unexpected else "",
        f"different shapes {_few(reshaped)}" if reshaped else "",
    ]
    if any(problems):
        raise IncompatibleCheckpoint(
            f"{checkpoint_dir} does not match the served model ({served_dir}): "
            + "; ".join(p for p in problems if p)
            + ". Publish a complete checkpoint of the same architecture (save_pretrained of the whole model)"
        )


def config_differences(checkpoint_dir: str | Path, served_dir: str | Path) -> list[str]:
    """config.json fields that differ; in-place reload swaps weights only, so these are not applied."""
    new, served = read_config(checkpoint_dir), read_config(served_dir)
    keys = sorted((new.keys() | served.keys()) - _CONFIG_NOISE)
    return [f"{key}: {served.get(key)!r} -> {new.get(key)!r}" for key in keys if new.get(key) != served.get(key)]


def reload_dir_for(checkpoint_dir: str | Path, reload_root: str | Path) -> Path:
    """Where prepare_reload_dir puts the reload copy of a checkpoint (one per source directory)."""
    source = Path(checkpoint_dir).resolve()
    digest = hashlib.sha1(str(source).encode()).hexdigest()[:12]
    return Path(reload_root) / f"{source.name}-{digest}"


def prepare_reload_dir(checkpoint_dir: str | Path, reload_root: str | Path) -> Path:
    """The directory to hand vLLM's reload_weights: the checkpoint itself, or a copy with a tied head.

    vLLM 0.32 reloads a tied output head only from an explicit lm_head.weight; without one the head
    keeps the previous weights (logs "ParallelLMHead: Failed to load weights"). For a tied checkpoint
    that lacks it, this builds a directory of symlinks to the checkpoint's files plus one small
    safetensors file holding lm_head.weight = embed_tokens.weight.
    """
    source = Path(checkpoint_dir)
    if not is_tied(source) or HEAD in tensor_shapes(source):
        return source
    target = reload_dir_for(source, reload_root)
    if (target / TIED_HEAD_FILE).exists():
        return target
    holder = next((path for path in weight_files(source) if EMBEDDING in read_header(path)), None)
    if holder is None:
        raise IncompatibleCheckpoint(
            f"{source} ties its embeddings but has no {EMBEDDING} to copy into {HEAD}; write {HEAD} "
            "explicitly into the checkpoint"
        )
    from safetensors import safe_open
    from safetensors.torch import save_file

    # A private build directory renamed into place: concurrent reloads of one checkpoint (several
    # servers, several watchers) never see a half-written copy.
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}-{os.urandom(4).hex()}")
    partial.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.is_file() and entry.name != INDEX_FILE:
            (partial / entry.name).symlink_to(entry.resolve())
    with safe_open(holder, framework="pt") as tensors:
        head = {HEAD: tensors.get_tensor(EMBEDDING).contiguous()}
    save_file(head, partial / TIED_HEAD_FILE, metadata={"format": "pt"})
    index = source / INDEX_FILE
    if index.exists():  # vLLM loads only the files an index names, so the head file must be listed
        content = json.loads(index.read_text())
        content["weight_map"][HEAD] = TIED_HEAD_FILE
        (partial / INDEX_FILE).write_text(json.dumps(content, indent=1))
    try:
        partial.rename(target)
    except OSError:  # another process finished the same copy first
        shutil.rmtree(partial, ignore_errors=True)
        if not (target / TIED_HEAD_FILE).exists():
            raise
    return target


def _few(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")

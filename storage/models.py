"""A model named by a storage URL (`s3://bucket/models/qwen`, any fsspec URL): what a part on any
host uses as its model, a local directory, fetched once into the host's cache. A local directory
or a hub id passes through untouched.

    model: s3://models/tiny      the trainer's nodes, the rollout workers' tokenizer, `clotho serve`

A model URL is read as immutable, as a published checkpoint is: its copy in
`$XDG_CACHE_HOME/clotho/models/` (~/.cache by default) is named by the URL and never fetched again.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

from core.cache import cache_dir
from storage.filesystem import download_whole, is_local, resolve, retrying, storage_errors
from storage.layout import join

log = logging.getLogger(__name__)

COMPLETE = ".clotho-complete"


def is_model_url(model: str) -> bool:
    """Whether `model` names a model in storage (a URL with a scheme), not a directory or hub id."""
    return "://" in model


def models_cache() -> Path:
    return cache_dir("models")


def check_model_url(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """`url` if it holds a Hugging Face model (its config.json); ValueError naming the fix otherwise."""
    fs, path = resolve(url, storage_options)
    try:
        with storage_errors(url):
            found = retrying(fs, join(path, "config.json"), fs.exists, join(path, "config.json"))
    except (FileNotFoundError, PermissionError, OSError) as error:
        raise ValueError(
            f"{url!r}: cannot be read ({' '.join(str(error).split())}); check the URL and the storage's credentials"
        ) from None
    if not found:
        raise ValueError(
            f"{url!r} holds no config.json: not a Hugging Face model directory; upload one there (save_pretrained, then copy it)"
        )
    return url


def local_model(model: str, storage_options: dict[str, Any] | None = None, cache: Path | None = None) -> str:
    """A local directory of `model`: a URL's copy in this host's cache (fetched once: to a
    directory aside, then renamed, so a copy cut short is never used), a file:// URL's own path;
    anything else as it is."""
    if not is_model_url(model):
        return model
    fs, path = resolve(model, storage_options)
    if is_local(fs):
        return path
    target = (cache or models_cache()) / hashlib.sha256(model.rstrip("/").encode()).hexdigest()[:16]
    if (target / COMPLETE).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with storage_errors(model):
        names = [name[len(path.rstrip("/")) + 1 :] for name in retrying(fs, path, fs.find, path)]
    if "config.json" not in names:
        raise ValueError(f"{model!r} holds no config.json: not a Hugging Face model directory")
    download_whole(model, fs, path, names, target, written_last={COMPLETE: model.encode()})
    log.info("model %s fetched to %s (%d files, %.1f s)", model, target, len(names), time.monotonic() - started)
    return str(target)

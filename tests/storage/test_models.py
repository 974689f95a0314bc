"""A model named by a storage URL (storage.models): checked by its config.json, fetched once into
the host's cache (a copy cut short never used), a local directory or hub id passed through."""

from __future__ import annotations

import pytest

from storage.filesystem import resolve
from storage.models import check_model_url, local_model
from trainer.config import check_model_source


def test_a_model_in_storage_is_fetched_once_into_the_cache(root, tmp_path):
    fs, path = resolve(f"{root}/models/tiny")
    fs.makedirs(f"{path}/sub", exist_ok=True)
    fs.pipe_file(f"{path}/config.json", b'{"model_type": "qwen2"}')
    fs.pipe_file(f"{path}/sub/tokenizer.json", b"{}")
    url = f"{root}/models/tiny"
    assert check_model_source(url) == check_model_url(url) == url
    cache = tmp_path / "cache"
    local = local_model(url, cache=cache)
    if root.startswith("file://"):
        assert local == path and not cache.exists()  # on this disk already: its own path
        return
    assert (tmp_path / "cache").exists() and open(f"{local}/sub/tokenizer.json").read() == "{}"
    fs.pipe_file(f"{path}/config.json", b"changed")  # a model URL is read as immutable: no second fetch
    assert local_model(url, cache=cache) == local and open(f"{local}/config.json").read() == '{"model_type": "qwen2"}'
    assert [p.name for p in cache.iterdir()] == [local.rsplit("/", 1)[-1]]  # nothing left aside


def test_a_url_without_a_model_is_refused_with_the_fix(root):
    fs, path = resolve(f"{root}/models/empty")
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(f"{path}/README", b"nothing here")
    with pytest.raises(ValueError, match="holds no config.json: not a Hugging Face model directory"):
        check_model_source(f"{root}/models/empty")
    assert local_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert local_model("/a/local/dir") == "/a/local/dir"

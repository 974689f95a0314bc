"""A Hugging Face qwen2 model written as a GGUF file (F32 tensors, gpt2 tokenizer metadata), the way
llama.cpp's converter lays it out: the stand-in for a user's own GGUF file in the tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

# Hugging Face module names -> llama.cpp's (gguf.constants), per layer and for the whole model.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
MODEL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(key: str) -> str:
    module, kind = key.rsplit(".", 1)
    if module in MODEL_NAMES:
        return f"{MODEL_NAMES[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{kind}"


def write_qwen2_gguf(model_dir: Path, out_file: Path) -> Path:
    """model_dir's qwen2 model (config, weights, tokenizer.json, chat template) as one GGUF file."""
    import gguf

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out_file), "qwen2")
    writer.add_name("clotho test qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tokenizer_json["model"]["vocab"] | {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda pair: pair[1])]
    added = {t["content"] for t in tokenizer_json["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens])
    merges = tokenizer_json["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id if config.pad_token_id is not None else config.eos_token_id)
    writer.add_bos_token_id(config.bos_token_id if config.bos_token_id is not None else config.eos_token_id)
    template = model_dir / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())
    else:
        writer.add_chat_template(json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"])

    for key, tensor in model.state_dict().items():
        if config.tie_word_embeddings and key == "lm_head.weight":
            continue
        writer.add_tensor(gguf_name(key), tensor.detach().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file

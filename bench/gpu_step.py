"""The trainer's step on one device: packing, attention, chunked log-probs and the loss at a model shape.

    python -m bench.gpu_step --size qwen2.5-0.5b --dtype bfloat16 --out $OUT/gpu_step.json   # a GPU
    python -m bench.gpu_step --size tiny --steps 2 --sequences 12                             # CPU, a test

The step's own code, without DeepSpeed, vLLM or Prefect (the device image has none of them; it needs
torch, transformers, pydantic and pyyaml): random groups of two sequences of random lengths go
through trainer.step.build_step (advantages, packing several sequences a row), each micro-batch
through trainer.model.micro_batch_loss (trainer.attention: on CUDA in bf16 the flash
variable-length kernel, elsewhere sdpa over buckets of alike lengths; the LM head in chunks), backward, and a torch
AdamW step on the weights in `--dtype`. It reports:

- `logprob_check`: the packed micro-batch's logprobs against each sequence scored alone (one
  sequence, plain causal attention), the largest |difference| over every trained token;
- tokens/s over the timed steps (after `--warmup`), and MFU: 6 x parameters x tokens/s (forward and
  backward; x 8/6 with gradient checkpointing's recompute) over the card's bf16 dense peak
  (`--peak-tflops`, else looked up by the device's name);
- peak memory: the CUDA allocator's peak, or the process's peak RSS on CPU.

`--attention mask` runs the trainer as it was before variable-length attention: rows that several
sequences share kept apart by the dense [rows, 1, L, L] mask (bench/bench_attention.py compares).

Prints one JSON line and writes it to `--out` when given.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]

# bf16 dense peak FLOP/s by the device's name (the vendors' data sheets, without sparsity).
PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def build_model(size: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A model of the shape `size` (inference.tiny_model.SHAPES) with random weights, with the
    trainer's attention (trainer.model.load_policy's, without a directory to load)."""
    from inference.tiny_model import model_config
    from trainer import attention

    ids = SimpleNamespace(convert_tokens_to_ids=lambda token: 1, eos_token_id=2, pad_token_id=0)
    config, model_class = model_config(size, ids)
    attention.register()
    config._attn_implementation = attention.NAME
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)
    return model.to(dtype).eval()  # eval: no dropout, as the trainer runs it


def groups(count: int, lengths: tuple[int, int], prompt: int, vocab: int, seed: int) -> list:
    """`count` groups of two sequences of random tokens and lengths, sampled logprobs and scores."""
    from core.scored_group import ScoredGroup, ScoredSequence

    rng = random.Random(seed)
    made = []
    for index in range(count):
        sequences = []
        for _ in range(2):
            total = rng.randint(*lengths)
            tokens = [rng.randrange(3, vocab) for _ in range(total)]
            sequences.append(
                ScoredSequence(
                    tokens=tokens,
                    mask=[False] * prompt + [True] * (total - prompt),
                    logprobs=[0.0] * prompt + [-3.0] * (total - prompt),
                    score=rng.random(),
                )
            )
        made.append(ScoredGroup(env="gpu-step", item_id=f"{seed}-{index}", sequences=sequences))
    return made


@torch.no_grad()
def logprob_check(model: torch.nn.Module, micro_batch, device: str) -> float:
    """The largest |packed - alone| logprob over the micro-batch's trained tokens."""
    from trainer.model import packed_logprobs, token_logprobs

    packed, _ = packed_logprobs(model, micro_batch, device=device)
    worst = 0.0
    for index in range(len(micro_batch.sequence_lengths)):
        where = micro_batch.sequence_ids == index
        ids = micro_batch.input_ids[where][None].to(device)
        alone = token_logprobs(model(input_ids=ids, use_cache=False).logits, ids)[0]
        trained = micro_batch.mask[where].to(device)
        worst = max(worst, float((packed[where.to(device)] - alone)[trained].abs().max()))
    return worst


def peak_memory(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run(args: argparse.Namespace) -> dict:
    from trainer.config import AdvantageConfig, LossConfig
    from trainer.model import enable_gradient_checkpointing, micro_batch_loss
    from trainer.step import build_step

    if args.attention == "mask":  # the trainer before the cut: the dense mask for rows that share
        from trainer.packing import PackedBatch

        PackedBatch.needs_mask = lambda self: self.shares_rows()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    model = build_model(args.size, dtype, device)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    parameters = sum(p.numel() for p in model.parameters())
    vocab = min(model.config.vocab_size, 512)  # the small tokenizer's ids, as sampling reaches them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    steps = [
        build_step(
            groups(args.sequences // 2, (args.min_tokens, args.max_tokens), args.prompt, vocab, seed),
            policy_version=0,
            token_budget=args.micro_batch_tokens,
            advantage_config=AdvantageConfig(),
            token_work=6 * model.config.hidden_size,
            share_prompts=False,
        )
        for seed in range(args.warmup + args.steps)
    ]
    # Checked on a micro-batch whose rows sequences share, where there is one: what the bounds keep apart.
    checked = next((mb for mb in steps[0].micro_batches if mb.shares_rows()), steps[0].micro_batches[0])
    check = logprob_check(model, checked, device)
    seconds, tokens = [], []
    for index, step in enumerate(steps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            if index == args.warmup:
                torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        for micro_batch in step.micro_batches:
            loss, _ = micro_batch_loss(model, micro_batch, LossConfig(), objectives=step.objectives, device=device)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if index >= args.warmup:
            seconds.append(time.perf_counter() - started)
            tokens.append(sum(int((mb.sequence_ids >= 0).sum()) for mb in step.micro_batches))
    tokens_per_s = sum(tokens) / sum(seconds)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next((v for k, v in PEAKS.items() if k in name), None)
    flops_per_token = (8 if args.gradient_checkpointing else 6) * parameters
    first = checked
    return {
        "size": args.size,
        "device": name,
        "dtype": args.dtype,
        "parameters": parameters,
        "attention": "dense mask"
        if args.attention == "mask"
        else ("flash varlen" if device.startswith("cuda") and dtype != torch.float32 else "sdpa buckets")
        if first.shares_rows()
        else "sdpa causal, one sequence a row",
        "rows": [list(mb.input_ids.shape) for mb in steps[0].micro_batches],
        "sequences_per_step": args.sequences,
        "micro_batch_tokens": args.micro_batch_tokens,
        "micro_batches": [len(step.micro_batches) for step in steps],
        "tokens_per_step": tokens,
        "step_seconds": [round(s, 4) for s in seconds],
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": float(f"{flops_per_token * tokens_per_s / peak:.4g}") if peak else None,
        "peak_flops": peak,
        "peak_memory_gib": round(peak_memory(device), 3),
        "logprob_check": check,
        "gradient_checkpointing": args.gradient_checkpointing,
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--sequences", type=int, default=64, help="Sequences a step (groups of two).")
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=64, help="Untrained tokens at each sequence's start.")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--attention",
        default="bounds",
        choices=["bounds", "mask"],
        help="Rows shared by sequences kept apart by their bounds (the trainer) or a dense mask (before).",
    )
    parser.add_argument("--peak-tflops", type=float, help="The device's bf16 dense peak (default: by its name).")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

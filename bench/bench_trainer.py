"""Trainer benchmark: DeepSpeed trainer step vs a plain PyTorch loop, and padding waste.

Prints two numbers measured in one run (issue 6 targets):
  speed    trainer tokens/s / plain-loop tokens/s                                          (>= 0.95)
           The trainer's own step (trainer.train.optimizer_step on a DeepSpeed engine built
           from the trainer config, its packed rows) against the best plain way: the same
           sequences as padded batches with a 2D padding mask through the model (as TRL and a
           hand-written loop batch them), the same loss, clip_grad_norm_ and torch.optim.AdamW,
           from the same initial weights (a Qwen2 of hidden 256, 4 layers). The two take turns
           step by step so load from other processes hits both alike; both models must end equal.
           Two step shapes: mixed (arithmetic and guess_number groups, lengths that differ) and
           demo (the demo's RL step: 8 prompts x 16 answers of a few tokens, all about one length,
           where the padded batch wastes almost nothing: demo_ratio).
  padding  padded slots / all slots when steps of the bundled environments' groups (arithmetic,
           guess_number: their prompts through the tiny model's chat template, completions of
           their default lengths) are packed with the default trainer config, beside the padded
           batches' (reported: rows trade some padding for less attention, see trainer.packing)

Usage: python -m bench.bench_trainer [--steps 8] [--groups-per-step 8] [--micro-batch-tokens 4096]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.results import write_result
from core.scored_group import ScoredGroup, ScoredSequence
from trainer.config import TrainerConfig
from trainer.distributed import build_engine, init_distributed
from trainer.losses import policy_loss
from trainer.model import load_policy, token_logprobs
from trainer.packing import TrainingSequence, padding_waste
from trainer.step import StepBatch, build_step, training_sequences
from trainer.train import optimizer_step

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / ".clotho" / "bench" / "tiny-tokenizer"
MAX_TOKENS = 32  # EnvironmentConfig.max_tokens: most tokens sampled per assistant turn
GROUP_SIZE = 4  # EnvironmentConfig.group_size
TURNS = 3  # GuessNumberConfig.turns
BENCH_HIDDEN = 256  # bench_model's hidden size


def tokenizer():
    from transformers import AutoTokenizer

    from inference.tiny_model import build_tiny_model

    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        build_tiny_model(TOKENIZER_DIR)
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def completion(rng: random.Random) -> list[int]:
    """Sampled tokens: an untrained policy stops early about half the time, else hits max_tokens."""
    length = rng.randint(1, MAX_TOKENS - 1) if rng.random() < 0.5 else MAX_TOKENS
    return [rng.randrange(3, 512) for _ in range(length)]


def chat_ids(tok, content: str) -> list[int]:
    """A user message through the chat template, up to the assistant's generation prompt."""
    messages = [{"role": "user", "content": content}]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def sequence(rng: random.Random, segments: list[tuple[list[int], bool]]) -> ScoredSequence:
    """A sequence from (tokens, trained) segments; sampled tokens get made-up sampler logprobs."""
    tokens, mask, logprobs = [], [], []
    for ids, trained in segments:
        tokens += ids
        mask += [trained] * len(ids)
        logprobs += [-rng.expovariate(2.0) if trained else 0.0 for _ in ids]
    return ScoredSequence(tokens=tokens, mask=mask, logprobs=logprobs, score=float(rng.random() < 0.3))


def arithmetic_group(tok, rng: random.Random) -> ScoredGroup:
    a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+-")
    prompt = chat_ids(tok, f"What is {a} {op} {b}? Give only the final answer.")
    sequences = [sequence(rng, [(prompt, False), (completion(rng), True)]) for _ in range(GROUP_SIZE)]
    return ScoredGroup(env="arithmetic", item_id=str(rng.random()), sequences=sequences)


def guess_number_group(tok, rng: random.Random) -> ScoredGroup:
    prompt = chat_ids(tok, f"Guess a number between 1 and 20. {TURNS} tries left.")
    sequences = []
    for _ in range(GROUP_SIZE):
        segments = [(prompt, False)]
        turns = rng.choice([1, 2, 3, 3, 3, 3])  # a right guess ends the conversation early
        for turn in range(turns):
            segments.append((completion(rng), True))
            if turn + 1 < turns:
                reply = f"Too {rng.choice(['low', 'high'])}. {TURNS - turn - 1} tries left."
                segments.append((chat_ids(tok, reply), False))  # the reply, then the next turn
        sequences.append(sequence(rng, segments))
    return ScoredGroup(env="guess_number", item_id=str(rng.random()), sequences=sequences)


def demo_group(tok, rng: random.Random) -> ScoredGroup:
    """The demo's RL group: 'Which is larger, a or b?' and 16 answers of 1-4 sampled tokens."""
    a, b = rng.sample(range(10), 2)
    prompt = chat_ids(tok, f"Which is larger, {a} or {b}? Give only the number.")
    answers = [[rng.randrange(3, 512) for _ in range(rng.choice([2, 3, 4, 4, 4]))] for _ in range(16)]
    return ScoredGroup(
        env="compare",
        item_id=str(rng.random()),
        sequences=[sequence(rng, [(prompt, False), (answer, True)]) for answer in answers],
    )


def environment_steps(
    tok, kind: str, steps: int, config: TrainerConfig, seed: int, token_work: int = 6 * BENCH_HIDDEN
) -> list[tuple[StepBatch, list[TrainingSequence]]]:
    """Steps of the bundled environments' groups, packed as the trainer packs them for the bench
    model (trainer.train passes 6 x its hidden size as token_work), each with its sequences whole
    (what the plain way batches: the trainer's layout may share a group's prompt)."""
    rng = random.Random(seed)
    makers = {"arithmetic": [arithmetic_group], "guess_number": [guess_number_group]}
    makers["mixed"] = makers["arithmetic"] + makers["guess_number"]
    makers["demo"] = [demo_group]
    result = []
    for _ in range(steps):
        groups = [rng.choice(makers[kind])(tok, rng) for _ in range(config.groups_per_step)]
        step = build_step(
            groups,
            policy_version=0,
            token_budget=config.micro_batch_tokens,
            advantage_config=config.advantages,
            token_work=token_work,
            share_prompts=config.share_prompts,
        )
        result.append((step, training_sequences(groups, config.advantages)))
    return result


def bench_model(directory: Path) -> Path:
    """A Qwen2 bigger than the tiny one (hidden 256, 4 layers), with the tiny vocabulary."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=BENCH_HIDDEN,
        intermediate_size=4 * BENCH_HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def padded_batches(whole: list[TrainingSequence], token_budget: int) -> list[dict[str, torch.Tensor]]:
    """The step's sequences as the plain way batches them (TRL, a hand-written loop): one sequence
    per row, right-padded to the longest of its batch, a 2D padding mask, rows in sequence order,
    as many rows per batch as the token budget holds."""
    sequences = [
        {
            "input_ids": torch.tensor(s.tokens),
            "mask": torch.tensor(s.mask),
            "old_logprobs": torch.tensor(s.old_logprobs, dtype=torch.float32),
            "advantages": torch.tensor(s.advantages, dtype=torch.float32),
        }
        for s in whole
    ]
    longest = max(len(s["input_ids"]) for s in sequences)
    per_batch = max(token_budget // longest, 1)
    batches = []
    for start in range(0, len(sequences), per_batch):
        chunk = sequences[start : start + per_batch]
        width = max(len(s["input_ids"]) for s in chunk)

        def padded(name: str, fill, chunk=chunk, width=width) -> torch.Tensor:
            return torch.stack([torch.nn.functional.pad(s[name], (0, width - len(s[name])), value=fill) for s in chunk])

        attention = torch.stack(
            [
                torch.nn.functional.pad(
                    torch.ones(len(s["input_ids"]), dtype=torch.long), (0, width - len(s["input_ids"]))
                )
                for s in chunk
            ]
        )
        batches.append(
            {
                "input_ids": padded("input_ids", 0),
                "attention_mask": attention,
                "mask": padded("mask", False),
                "old_logprobs": padded("old_logprobs", 0.0),
                "advantages": padded("advantages", 0.0),
            }
        )
    return batches


def plain_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    whole: list[TrainingSequence],
    config: TrainerConfig,
) -> None:
    """The same step the best plain way: the sequences as padded batches (padded_batches) through
    the model with a 2D padding mask, the same loss over the step's counts, backward, clipping and
    torch's AdamW."""
    (share,) = batch.objectives.values()
    for padded in padded_batches(whole, config.micro_batch_tokens):
        logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], use_cache=False).logits
        loss, _ = policy_loss(
            token_logprobs(logits, padded["input_ids"]),
            padded["old_logprobs"],
            padded["advantages"],
            padded["mask"],
            config.loss,
            step_num_sequences=share.num_sequences,
            step_num_tokens=share.num_trained_tokens,
        )
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="Timed steps of each loop.")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    args = parser.parse_args()

    tok = tokenizer()
    defaults = TrainerConfig(model="unused")
    print(
        f"padding waste, default trainer config (groups_per_step {defaults.groups_per_step}, "
        f"micro_batch_tokens {defaults.micro_batch_tokens}), 64 steps:"
    )
    padding, control_padding = {}, {}
    for kind in ("arithmetic", "guess_number", "mixed"):
        steps = environment_steps(tok, kind, 64, defaults, seed=1)
        tokens = sum(s.stats["tokens"] for s, _ in steps) / len(steps)
        micro_batches = sum(len(s.micro_batches) for s, _ in steps) / len(steps)
        waste = padding_waste([b for s, _ in steps for b in s.micro_batches])
        padded = [b for _, whole in steps for b in padded_batches(whole, defaults.micro_batch_tokens)]
        control_waste = 1 - sum(int(b["attention_mask"].sum()) for b in padded) / sum(
            b["attention_mask"].numel() for b in padded
        )
        padding[kind] = round(waste, 4)
        control_padding[kind] = round(control_waste, 4)
        print(
            f"  {kind:13s} {waste:6.2%}  ({tokens:.0f} tokens, {micro_batches:.1f} micro-batches a step; padded batches waste {control_waste:.2%})"
        )

    cases = {}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as temporary:
        model_dir = bench_model(Path(temporary) / "model")
        config = TrainerConfig(
            model=str(model_dir),
            lr=1e-5,
            groups_per_step=args.groups_per_step,
            micro_batch_tokens=args.micro_batch_tokens,
        )
        rank, world_size = init_distributed()
        for kind in ("mixed", "demo"):
            # demo: the demo's RL step, 8 prompts x 16 answers of a few tokens (all about one length).
            batches = environment_steps(tok, kind, args.warmup + args.steps, config, seed=2)
            cases[kind] = time_trainer_and_plain(config, batches, args.warmup, rank, world_size)
    for kind, case in cases.items():
        print(
            f"speed, {kind}: {args.steps} steps of {case['tokens_per_step']:.0f} tokens "
            f"(hidden 256, 4 layers, {torch.get_num_threads()} threads):"
        )
        print(f"  trainer (DeepSpeed) {case['trainer_tokens_per_s']:8.0f} tokens/s")
        print(f"  plain torch, padded {case['plain_tokens_per_s']:8.0f} tokens/s")
        print(f"  ratio               {case['ratio']:8.3f}  (target >= 0.95)")
        print(
            f"  median step ratio   {case['median_step_ratio']:8.3f}  (steps {case['step_ratio_range'][0]:.3f}-{case['step_ratio_range'][1]:.3f})"
        )
        print(f"  max weight difference after training: {case['max_weight_difference']:.2e}")
    mixed = cases["mixed"]
    write_result(
        "trainer",
        {
            "targets": {"ratio": ">= 0.95", "demo_ratio": ">= 0.95"},
            "control": "padded batches of whole sequences, 2D mask, plain torch",
            "steps": args.steps,
            "control_padding_waste": control_padding,
            "padding_waste": padding,
            **{key: value for key, value in mixed.items() if key != "tokens_per_step"},
            "demo": {key: value for key, value in cases["demo"].items() if key != "tokens_per_step"},
            "demo_ratio": cases["demo"]["ratio"],
        },
    )


def time_trainer_and_plain(
    config: TrainerConfig,
    batches: list[tuple[StepBatch, list[TrainingSequence]]],
    warmup: int,
    rank: int,
    world_size: int,
) -> dict:
    """The trainer's step and the plain padded step on the same batches from the same weights,
    taking turns step by step; tokens/s of each, their ratio and how far the weights ended apart."""
    trainer_model = load_policy(config.model)
    engine = build_engine(trainer_model, config, world_size)
    plain = load_policy(config.model)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=config.lr, weight_decay=0.0)
    spent: dict[str, list[float]] = {"trainer": [], "plain": []}
    tokens = 0.0
    shared = []
    for index, (batch, whole) in enumerate(batches):
        started = time.perf_counter()
        optimizer_step(engine, batch, config, rank=rank, world_size=world_size)
        middle = time.perf_counter()
        plain_step(plain, optimizer, batch, whole, config)
        ended = time.perf_counter()
        if index >= warmup:
            spent["trainer"].append(middle - started)
            spent["plain"].append(ended - middle)
            tokens += batch.stats["tokens"]
            shared.append(batch.stats["shared_prefix_tokens"] / batch.stats["tokens"])
    difference = max(
        (a - b).abs().max().item() for a, b in zip(engine.module.parameters(), plain.parameters(), strict=True)
    )
    trainer_speed, plain_speed = tokens / sum(spent["trainer"]), tokens / sum(spent["plain"])
    # Per step: a load spike from another process then skews one step's ratio, not the total.
    step_ratios = [p / t for p, t in zip(spent["plain"], spent["trainer"], strict=True)]
    return {
        "tokens_per_step": tokens / len(spent["trainer"]),
        "trainer_tokens_per_s": round(trainer_speed),
        "plain_tokens_per_s": round(plain_speed),
        "ratio": round(trainer_speed / plain_speed, 3),
        "median_step_ratio": round(statistics.median(step_ratios), 3),
        "step_ratio_range": [round(min(step_ratios), 3), round(max(step_ratios), 3)],
        "max_weight_difference": difference,
        "shared_prefix_fraction": round(statistics.fmean(shared), 3),  # of the tokens: laid out once per group
    }


if __name__ == "__main__":
    main()

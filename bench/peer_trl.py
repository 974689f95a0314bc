"""TRL's GRPOTrainer on a clotho environment's items and reward: the other side of bench/bench_peer.py.

    .venv-trl/bin/python -m bench.peer_trl --model DIR --env compare --env-config '{"seed": 7, ...}'
        --steps 120 --prompts-per-step 8 --lr 5e-4 --seed 0 --save-every 5 --out DIR

Runs in its own environment (requirements/env-base.lock + requirements/peer-trl.lock), as a user of
TRL would, on CPU with transformers' `generate`. The prompts are the environment's own items, in
the order its `get_item` hands them out, and the reward is its own `reward`: the task clotho trains
on, scored by the same code. Settings mirror clotho's `grpo` loss (per-sequence token mean, PPO
clip, no KL, one update per batch, constant lr, AdamW with no weight decay, gradient norm clipped
to 1); gradient checkpointing is off unless --gradient-checkpointing (TRL's default turns it on: the
same maths, slower; bench_scale.py turns it on at the real shapes, as on clotho's side).

Writes OUT/steps.jsonl: a row per step when it ends (its wall-clock `time`, TRL's logged reward and
completion length) and a row per checkpoint with the seconds the save took (the bench takes them
out of TRL's time: clotho must publish every step, a TRL user would not save this often), and
OUT/checkpoint-N/ every --save-every steps and at the last.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from environments.loading import environment_items


class StepLog(TrainerCallback):
    """One JSON line per step as it ends and per checkpoint saved, with wall-clock times."""

    def __init__(self, path: Path):
        self.file = path.open("w")
        self.step_ended: dict[int, float] = {}

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ended[state.global_step] = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" in logs:
            self.write(
                {
                    "step": state.global_step,
                    "time": self.step_ended.get(state.global_step, time.time()),
                    "reward": logs["reward"],
                    "completion_length": logs.get("completions/mean_length"),
                    "grad_norm": logs.get("grad_norm"),
                    "clip_fraction": logs.get("clip_ratio/region_mean"),
                }
            )

    def on_save(self, args, state, control, **kwargs):
        ended = self.step_ended.get(state.global_step)
        self.write({"saved": state.global_step, "save_s": time.time() - ended if ended else 0.0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--env", required=True, help="an environment name or module:Class")
    parser.add_argument(
        "--env-config", default="{}", help="its config as JSON (group_size, max_tokens, temperature, seed)"
    )
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute layers in the backward (models of real sizes)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    env, items = environment_items(
        args.env, json.loads(args.env_config), args.model, args.steps * args.prompts_per_step
    )
    config = env.config
    by_id = {item.id: item for item in items}
    dataset = Dataset.from_list([{"prompt": item.prompt, "item_id": item.id} for item in items])

    def reward(prompts, completions, item_id, **kwargs) -> list[float]:
        return [
            env.reward(by_id[i], [*prompt, *completion]) for prompt, completion, i in zip(prompts, completions, item_id)
        ]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    training = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        seed=args.seed,
        report_to="none",
        logging_steps=1,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=args.prompts_per_step * config.group_size,
        gradient_accumulation_steps=1,
        num_generations=config.group_size,
        max_completion_length=config.max_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        shuffle_dataset=False,
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        num_iterations=1,
        # fp32 like clotho's side: GRPOConfig's default is bf16=True, which on CPU autocasts to bfloat16.
        bf16=False,
        gradient_checkpointing=args.gradient_checkpointing,
        save_strategy="steps",
        save_steps=args.save_every,
        save_only_model=True,
        dataloader_num_workers=0,
        disable_dropout=True,
        log_completions=False,
    )
    log = StepLog(out / "steps.jsonl")
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward,
        args=training,
        train_dataset=dataset,
        callbacks=[log],
    )
    trainer.train()
    log.file.close()


if __name__ == "__main__":
    main()

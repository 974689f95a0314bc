"""DeepSpeed setup: the process group (one process or a torchrun/deepspeed launch), the engine."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from typing import Any

import torch

from core.processes import free_port
from trainer.config import TrainerConfig

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_distributed() -> tuple[int, int]:
    """Join (or, for a plain `python`, create) the process group; returns (rank, world size).

    torchrun and the deepspeed launcher set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT. A plain single process gets rank 0 of 1 on a free local port; without them
    DeepSpeed would go looking for MPI. Backend: NCCL with CUDA, gloo on CPU.
    """
    given = [name for name in _LAUNCHER_VARIABLES if name in os.environ]
    if given and len(given) != len(_LAUNCHER_VARIABLES):
        missing = sorted(set(_LAUNCHER_VARIABLES) - set(given))
        raise RuntimeError(
            f"{', '.join(missing)} not set while {', '.join(given)} are; launch with torchrun or "
            "deepspeed (they set all five), or unset them all for a single process"
        )
    if not given:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    # On CPU DeepSpeed JIT-compiles its shared-memory collectives (about 70 s on 2 cores) when the
    # process group is created. They serve only `inference_all_reduce` (tensor-parallel inference);
    # training reduces through gloo, so the op is marked unavailable. DeepSpeed caches this dict on
    # purpose so edits persist (deepspeed/ops/__init__.py); there is no environment variable for it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    for attempt in range(3):
        try:
            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
            break
        except torch.distributed.DistNetworkError as error:
            # The free port this process chose was taken before it listened (another process,
            # between free_port and the bind): choose again. A launcher's port is not ours to change.
            if given or "EADDRINUSE" not in str(error) or attempt == 2:
                raise
            os.environ["MASTER_PORT"] = str(free_port())
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def deepspeed_config(config: TrainerConfig) -> dict[str, Any]:
    """The DeepSpeed engine config for a trainer config.

    One micro-batch is one packed row, and how many a step has depends on the step's sequences, so
    the caller owns the accumulation boundary (`managed_gradient_accumulation: false`): every
    `backward` accumulates, `step` reduces across ranks and updates, and losses are not divided by
    an accumulation count (they are normalized by the step's counts, see trainer.losses).
    """
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": config.grad_clip or 0.0,
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW: no op to compile on any device. No weight decay: RL updates are tiny
            # and decay would pull weights toward zero for reasons unrelated to the reward.
            "params": {"lr": config.lr, "weight_decay": 0.0, "torch_adam": True},
        },
        "zero_optimization": {"stage": config.zero_stage},
        "bf16": {"enabled": config.dtype == "bfloat16"},
        "steps_per_print": 2**31 - 1,  # the trainer logs its own metrics
    }


# Blocks from this size up are mapped and unmapped on their own (glibc's mmap threshold), so what a
# step frees goes back to the system. glibc's own threshold grows with the blocks freed up to 32 MB,
# and the gradients and activations below it that a step frees stay in its heap, fragmented: at the
# 0.5B shape a step held 3.2 GB more than it needs and peaked at 11.8 GB, 9.7 GB with this
# (bench/bench_scale_memory.py).
MMAP_THRESHOLD = 4 * 2**20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def build_engine(model: torch.nn.Module, config: TrainerConfig, world_size: int):
    """The DeepSpeed engine over `model` (deepspeed_config), in a process whose allocator gives
    back what a step frees (MMAP_THRESHOLD, glibc only)."""
    import deepspeed

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # a libc other than glibc: its own policy
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=deepspeed_config(config))
    if world_size == 1 and config.zero_stage == 0:
        # One rank has nothing to reduce, and at ZeRO 0 DeepSpeed would still copy every gradient
        # into flat buckets of 500M elements and back: 2 GB more at the 0.5B shape, 1 s a step here.
        engine.enable_backward_allreduce = False
    return engine


def broadcast_object(value: Any, world_size: int) -> Any:
    """Rank 0's `value` on every rank (pickled; for small Python objects such as groups)."""
    if world_size == 1:
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(value: Any, world_size: int) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank."""
    if world_size == 1:
        return [value]
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, value)
    return gathered

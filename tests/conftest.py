"""The suite's session fixtures (the tiny model, one live vLLM-CPU server) come from clotho's own
pytest plugin, environments.testing, which every installed clotho provides; re-exported here for
the tests that build models of their own. One real Prefect server (SQLite) serves every test that
runs a flow (tests/flows, tests/interop)."""

import pytest

from environments.testing import CACHE, cached_tiny_model  # noqa: F401
from tests.prefect_server import start_prefect_server


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"))
    yield server
    server.stop()

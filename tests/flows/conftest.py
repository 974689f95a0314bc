"""Fixtures for flow tests: one real Prefect server (SQLite) per session."""

import pytest

from tests.prefect_server import start_prefect_server


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"))
    yield server
    server.stop()

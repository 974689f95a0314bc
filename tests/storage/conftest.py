"""Storage fixtures: the same tests run on file://, memory:// and a real S3 API server (moto)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import fsspec
import pytest
import s3fs

from tests.s3_server import S3Server, create_bucket, start_s3_server, stop_s3_server

BUCKET = "clotho-test"
BACKENDS = ["file", "memory", pytest.param("s3", marks=pytest.mark.integration)]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = start_s3_server()
    saved = {name: os.environ.get(name) for name in server.environment}
    os.environ.update(server.environment)
    # fsspec caches S3 filesystems by their arguments, not the environment: drop any made for
    # another server earlier in the session.
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        create_bucket(server, BUCKET)
        yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        s3fs.S3FileSystem.clear_instance_cache()  # nor leave one pointing at a stopped server
        stop_s3_server(server)


@pytest.fixture(params=BACKENDS)
def root(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh, empty storage root URL on one backend."""
    unique = uuid.uuid4().hex[:12]
    if request.param == "file":
        yield f"file://{tmp_path}/store"
    elif request.param == "memory":
        yield f"memory://clotho-{unique}"
        with contextlib.suppress(FileNotFoundError):
            fsspec.filesystem("memory").rm(f"/clotho-{unique}", recursive=True)
    else:
        request.getfixturevalue("s3_server")
        yield f"s3://{BUCKET}/{unique}"

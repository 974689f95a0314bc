"""Storage fixtures: the same tests run on file://, memory:// and a real S3 API server (moto)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import fsspec
import pytest

from clotho.testing.s3_server import S3Server, s3_bucket

BUCKET = "clotho-test"
BACKENDS = ["file", "memory", pytest.param("s3", marks=pytest.mark.integration)]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with s3_bucket(BUCKET) as server:
        yield server


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

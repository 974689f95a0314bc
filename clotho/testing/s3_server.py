"""A real S3 API server for tests: moto in server mode on loopback, started as a subprocess."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# moto accepts any credentials; these keep s3fs/botocore from looking for real ones.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",  # not client_kwargs: region_name there breaks bucket creation
}


@dataclass
class S3Server:
    endpoint_url: str
    process: subprocess.Popen[bytes]
    log_path: Path  # the server logs every request; a file, because an unread pipe would fill and block it

    @property
    def environment(self) -> dict[str, str]:
        """Variables that point botocore, s3fs and clotho's storage at this server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint_url}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_s3_server(timeout_s: float = 30.0) -> S3Server:
    """Start `moto_server` (installed beside this Python) on a free loopback port and wait for it."""
    binary = Path(sys.executable).with_name("moto_server")
    if not binary.exists():
        raise FileNotFoundError(f"{binary} not found; install the dev extras: pip install 'moto[server]'")
    port = _free_port()
    log_path = Path(tempfile.mkstemp(prefix="moto-server-", suffix=".log")[1])
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **CREDENTIALS},
        )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto_server exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return S3Server(endpoint, process, log_path)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    process.kill()
    raise TimeoutError(f"moto_server did not answer on {endpoint} within {timeout_s} s")


def stop_s3_server(server: S3Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    server.log_path.unlink(missing_ok=True)


def create_bucket(server: S3Server, bucket: str) -> None:
    """Create a bucket through s3fs, the same client clotho's storage uses."""
    import s3fs

    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=server.endpoint_url, skip_instance_cache=True)
    fs.mkdir(bucket)


@contextlib.contextmanager
def s3_bucket(bucket: str) -> Iterator[S3Server]:
    """A moto server with `bucket` created, the AWS variables pointing at it while it runs (every
    process started meanwhile inherits them); stopped on the way out."""
    server = start_s3_server()
    try:
        with s3_environment(server.environment):
            create_bucket(server, bucket)
            yield server
    finally:
        stop_s3_server(server)


@contextlib.contextmanager
def s3_environment(variables: dict[str, str]) -> Iterator[None]:
    """Sets the AWS variables that point s3fs at a test server, and restores them after. fsspec
    caches S3 filesystems by their arguments, not the environment: the cache is dropped on the way
    in (no filesystem made for another server) and out (none left pointing at a stopped one)."""
    import s3fs

    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        s3fs.S3FileSystem.clear_instance_cache()

"""A real `prefect server start` (SQLite) on a free loopback port, for flow and deployment tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from inference.server import free_port

PREFECT = str(Path(sys.executable).with_name("prefect"))


@dataclass
class PrefectServer:
    process: subprocess.Popen
    port: int
    home: Path

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for CLI calls and workers that talk to this server."""
        env = dict(os.environ)
        env.update(
            PREFECT_API_URL=self.api_url,
            PREFECT_HOME=str(self.home),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_LOGGING_LEVEL="INFO",
        )
        return env

    def cli(self, *args: str, cwd: str | Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [PREFECT, *args], env=self.env(), cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
        if result.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


def start_prefect_server(home: Path, timeout: float = 180) -> PrefectServer:
    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "ab")
    process = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = PrefectServer(process, port, home)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prefect server exited: {(home / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{server.api_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"prefect server not healthy after {timeout}s: {(home / 'server.log').read_text()[-2000:]}")

"""A real `prefect server start` (SQLite) on a free loopback port, for flow and deployment tests,
benches and the soak: the one clotho's commands start, with a handle to call its CLI and stop it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from clotho.flow_runtime import serve_prefect, stop_server

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
            stop_server(self.process.pid)


def start_prefect_server(home: Path, timeout: float = 180) -> PrefectServer:
    """The Prefect server `clotho` commands start (clotho.flow_runtime.serve_prefect: a free loopback
    port, a session of its own, ended with this process), with its database in `home`."""
    home.mkdir(parents=True, exist_ok=True)
    url, process = serve_prefect(home, timeout)
    return PrefectServer(process, urlsplit(url).port, home)

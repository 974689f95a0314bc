"""A cluster of hosts on this machine for tests (cluster/cluster.sh: network namespaces on a bridge,
each host its own address, loopback, hostname, /tmp and a read-only checkout)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "cluster" / "cluster.sh"
# moto accepts any credentials; every host points botocore, s3fs and clotho's storage at host a's.
S3_CREDENTIALS = ("AWS_ACCESS_KEY_ID=testing", "AWS_SECRET_ACCESS_KEY=testing", "AWS_DEFAULT_REGION=us-east-1")


def unavailable() -> str | None:
    """Why no cluster can be built here (not root, no network namespaces), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"clotho-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Cluster:
    """Hosts a, b, c, d of the cluster `name` (their names on the bridge: NAME-a ...)."""

    def __init__(self, name: str):
        self.name = name
        self.env = {**os.environ, "CLOTHO_CLUSTER": name, "CLOTHO_CLUSTER_ROOT": f"/var/tmp/{name}"}
        self.root = Path(self.env["CLOTHO_CLUSTER_ROOT"])

    def host(self, host: str) -> str:
        return f"{self.name}-{host}"

    def script(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def up(self) -> None:
        done = self.script("up")
        if done.returncode != 0:
            raise RuntimeError(f"cluster up: {done.stderr}")

    def down(self) -> None:
        self.script("down", timeout=120)

    def run(self, host: str, command: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """`command` (a shell line) on `host`, to its end."""
        done = self.script("exec", host, "--", "bash", "-c", command, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"on {host}: {command!r} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def spawn(self, host: str, name: str, command: str) -> None:
        """`command` on `host` in the background; its output in the host's /tmp/NAME.log."""
        done = self.script("spawn", host, name, "--", "bash", "-c", command)
        if done.returncode != 0:
            raise RuntimeError(f"spawn on {host}: {done.stderr}")

    def log(self, host: str, name: str) -> str:
        path = self.root / host / "tmp" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_exit(self, host: str, name: str, timeout: float) -> None:
        """Waits for what spawn(host, name, ...) started to end (its pid, as the machine sees it)."""
        pid = int((self.root / host / "tmp" / f"{name}.pid").read_text())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # ended, not yet reaped by whatever adopted it
            except (ProcessLookupError, FileNotFoundError):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{name} on {host} still running after {timeout} s:\n{self.log(host, name)[-3000:]}")

    def wait(self, host: str, test: str, what: str, timeout: float, logs: tuple[tuple[str, str], ...] = ()) -> str:
        """Polls the shell test `test` on `host` until it exits 0; its output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.run(host, test, timeout=30, check=False)
            if done.returncode == 0:
                return done.stdout
            time.sleep(1.0)
        tails = "\n".join(f"--- {h}:{n}.log\n{self.log(h, n)[-3000:]}" for h, n in logs)
        raise TimeoutError(f"{what}: not within {timeout} s (on {host}: {test})\n{tails}")

    def s3_env(self) -> str:
        return " ".join((*S3_CREDENTIALS, f"AWS_ENDPOINT_URL=http://{self.host('a')}:5000"))

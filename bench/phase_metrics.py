"""Measuring one phase of a benchmark on a machine it shares with a policy server: CPU by process,
time the client's event loop waited for a CPU, CPU steal, the server's requests running, each
core's busy share; waiting for a process tree to go idle; pinning a server's threads."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import httpx
import psutil


def process_cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU of one process."""
    times = proc.cpu_times()
    return times.user + times.system


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes and all their children."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            total += sum(process_cpu_seconds(proc) for proc in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            continue
    return total


def run_queue_wait_seconds() -> float:
    """Time this thread was runnable but waiting for a CPU (Linux schedstat). The clients' event
    loops run in the main thread, so this says how long each side's client waited for the machine."""
    try:
        return int(Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def steal_seconds() -> float:
    """CPU time the hypervisor gave to other guests (Linux /proc/stat), machine-wide."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def measured(fn, server: list[int], url: str | None = None) -> dict[str, float]:
    """Runs one phase; wall time, tokens (fn returns them, or a flow_run dict that also has the
    running time and task runs), and CPU by this process, by its children (the ephemeral Prefect
    server, counted until it has recorded the phase's last events) and by the policy server."""
    me = psutil.Process()
    own0, tree0, srv0 = process_cpu_seconds(me), cpu_seconds([os.getpid()]), cpu_seconds(server)
    steal0, wait0, start = steal_seconds(), run_queue_wait_seconds(), time.perf_counter()
    with ServerLoad(url) as load:
        result = fn()
    seconds = time.perf_counter() - start
    flow = result if isinstance(result, dict) else {"tokens": result, "running": seconds, "task_runs": 0}
    steal, waited = steal_seconds() - steal0, run_queue_wait_seconds() - wait0
    settle()  # the Prefect server records task runs in batches, up to a second after they end
    own, tree = process_cpu_seconds(me) - own0, cpu_seconds([os.getpid()]) - tree0
    return {
        "seconds": seconds,
        "running": flow["running"],
        "tokens": flow["tokens"],
        "task_runs": flow["task_runs"],
        "client_cpu": own,
        "prefect_server_cpu": tree - own,
        "vllm_cpu": cpu_seconds(server) - srv0,
        "steal": steal,
        "client_waiting_for_cpu": waited,
        # Time-weighted over the phase by summing: mean requests running x seconds.
        "running_requests_s": load.mean_running * seconds,
        **{f"core{i}_busy": busy for i, busy in enumerate(load.core_busy)},
    }


class ServerLoad:
    """Samples the policy server's requests running (vLLM's /metrics gauge) and each core's busy
    time while a phase runs: a side that keeps fewer requests in flight loses by latency, one that
    keeps as many but is slower loses to CPU contention."""

    def __init__(self, url: str | None, interval_s: float = 0.25):
        self.url, self.interval_s = url, interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as http:
            while not self._stop.wait(self.interval_s):
                try:
                    text = http.get(f"{self.url}/metrics").text
                except httpx.HTTPError:
                    continue
                match = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
                if match:
                    self.samples.append(float(match.group(1)))

    def __enter__(self) -> ServerLoad:
        self._cores0 = psutil.cpu_times(percpu=True)
        if self.url:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.url:
            self._thread.join()
        cores = psutil.cpu_times(percpu=True)
        self.core_busy = [
            (sum(c1) - c1.idle - c1.iowait - c1.steal) - (sum(c0) - c0.idle - c0.iowait - c0.steal)
            for c0, c1 in zip(self._cores0, cores, strict=True)
        ]

    @property
    def mean_running(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else float("nan")


def settle(max_s: float = 30.0) -> None:
    """Waits until this process tree is idle, so one phase's leftovers (the Prefect server still
    recording the last flow's task runs) are not billed to the next phase."""
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        before = cpu_seconds([os.getpid()])
        time.sleep(0.5)
        if cpu_seconds([os.getpid()]) - before < 0.02:
            return


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of a process tree onto `cpus` (affinity is per thread on Linux)."""
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        for thread in proc.threads():
            try:
                os.sched_setaffinity(thread.id, cpus)
            except ProcessLookupError:
                continue  # ended meanwhile

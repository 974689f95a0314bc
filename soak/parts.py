"""The loop's parts as the real processes a run has, each one SIGKILL-able and restartable.

    Prefect server     prefect server start                  (its SQLite database survives a kill)
    policy server      vLLM, inference.server.PolicyServer   (restarted on the base model, as a supervisor would)
    reload watcher     clotho watch --run RUN --server URL
    trainer            python -m trainer.cli --run RUN ...   (resumes from its state)
    rollout flow       clotho rollout --env soak.groups:Distinct --run RUN --groups N

Every part runs in a session of its own, so a kill reaches exactly it (and, for vLLM and Prefect,
the processes it started) and a Ctrl-C of the soak reaches none of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from clotho.flow_runtime import prefect_server_process
from core.processes import stop_process, wait_answering
from inference.server import PolicyServer

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def part_environment(prefect_api_url: str | None, prefect_home: Path | None) -> dict[str, str]:
    """What every clotho process of the soak runs with: the repository importable (the soak's
    environment is `soak.groups:Distinct`), unbuffered logs, the soak's Prefect server."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    if prefect_api_url:
        env["PREFECT_API_URL"] = prefect_api_url
    if prefect_home:
        env["PREFECT_HOME"] = str(prefect_home)
    return env


class Part:
    """One process: start, SIGKILL (its whole session with `whole_group`), restart the same way."""

    def __init__(
        self, name: str, command: list[str], *, env: dict[str, str], log_path: Path, whole_group: bool = False
    ):
        self.name, self.command, self.env, self.log_path = name, command, env, log_path
        self.whole_group = whole_group
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        self.starts = 0
        self.killed = False  # by the soak, since the last start

    def start(self) -> Part:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start {self.starts + 1} at {time.time():.3f}: {' '.join(self.command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started_at, self.started_wall = time.monotonic(), time.time()
        self.starts += 1
        self.killed = False
        return self

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill(self) -> float:
        """SIGKILL now; returns the time.time() of the kill once the process is gone."""
        assert self.process is not None, f"{self.name} was never started"
        killed_at = time.time()
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            if self.whole_group:
                os.killpg(self.process.pid, signal.SIGKILL)
            else:
                self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        if self.whole_group:  # what it started, should one have left the session's group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        return killed_at

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the part's clean stop), SIGKILL after timeout_s."""
        if self.alive:
            stop_process(self.process, timeout_s)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, characters: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-characters:]
        except FileNotFoundError:
            return "(no log)"

    def log_since_start(self) -> str:
        """The log of the current start only."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[text.rfind("\n===== start ") :]


def wait_healthy(url: str, part: Part, timeout_s: float) -> None:
    if wait_answering(url, lambda: part.alive, timeout_s, poll_s=0.3):
        return
    if not part.alive:
        raise RuntimeError(f"{part.name} exited ({part.returncode}) before {url} answered:\n{part.log_tail()}")
    raise RuntimeError(f"{part.name}: {url} not healthy after {timeout_s:.0f}s:\n{part.log_tail()}")


class PrefectPart(Part):
    """`prefect server start` on a fixed port and home, so a restart is the same server."""

    def __init__(self, home: Path, port: int):
        home.mkdir(parents=True, exist_ok=True)
        command, env = prefect_server_process(home, port, part_environment(None, home))
        super().__init__("prefect", command, env=env, log_path=home / "server.log", whole_group=True)
        self.home, self.port = home, port

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self, timeout_s: float = 180.0) -> PrefectPart:
        super().start()
        wait_healthy(f"{self.api_url}/health", self, timeout_s)
        return self


class PolicyPart:
    """A vLLM server on a fixed port: SIGKILL of its whole process group (as the OOM killer or a
    lost container would), restart on the base model (as a supervisor would)."""

    name = "vllm"

    def __init__(self, model: Path, port: int, log_path: Path):
        self.server = PolicyServer(model, port=port, log_path=log_path)
        self.starts = 0

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def start(self, timeout_s: float = 900.0) -> PolicyPart:
        self.server.start(timeout=timeout_s)
        self.starts += 1
        return self

    @property
    def alive(self) -> bool:
        return self.server.process is not None and self.server.process.poll() is None

    def kill(self) -> float:
        process = self.server.process
        killed_at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        self.server.process = None
        return killed_at

    def pause(self, seconds: float) -> float:
        """SIGSTOP its whole process group (a host frozen, a VM paused, a debugger attached), SIGCONT
        `seconds` later; returns the moment it stopped."""
        group = self.server.process.pid
        stopped_at = time.time()
        os.killpg(group, signal.SIGSTOP)
        threading.Timer(seconds, _continue, [group]).start()
        return stopped_at

    def stop(self) -> None:
        self.server.stop()


def _continue(group: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # stopped for good meanwhile
        os.killpg(group, signal.SIGCONT)


def watcher_part(
    run_url: str, server_url: str, model: Path, work: Path, env: dict[str, str], poll_s: float, step_timeout_s: float
) -> Part:
    command = [
        str(BIN / "clotho"),
        "watch",
        "--run",
        run_url,
        "--server",
        server_url,
        "--base-model",
        str(model),
        "--poll-s",
        str(poll_s),
        "--cache-dir",
        str(work / "reload-cache"),
        "--reload-step-timeout-s",
        str(step_timeout_s),
    ]
    return Part("watcher", command, env=env, log_path=work / "logs" / "watcher.log")


def trainer_part(
    run_url: str,
    model: Path,
    steps: int,
    settings: dict[str, object],
    work: Path,
    env: dict[str, str],
    name: str = "trainer",
    ranks: int = 1,
    work_dir: Path | None = None,
) -> Part:
    """`work_dir`: the trainer's own (resume state, staging); by default the run's (trainer.train.default_work_dir)."""
    args = ["--run", run_url, "--model", str(model), "--steps", str(steps), "--data-timeout-s", "3600"]
    if work_dir is not None:
        args += ["--work-dir", str(work_dir)]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value)}"]  # YAML values: None is null
    if ranks == 1:
        command = [sys.executable, "-m", "trainer.cli", *args]
    else:  # torchrun reads --run as its own --run-path without the `--`
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "-m", "trainer.cli", "--", *args]
    return Part(name, command, env=env, log_path=work / "logs" / f"{name}.log", whole_group=ranks > 1)


def rollout_part(
    run_url: str,
    server_url: str,
    model: Path,
    groups: int,
    seed: int,
    work: Path,
    env: dict[str, str],
    *,
    name: str = "rollout",
    group_size: int = 4,
    delay_s: float = 0.0,
    sample_tokens: int = 0,
    lanes: int = 2,
    shard_max_age_s: float = 2.0,
    task_run_s: float = 2.0,
    grader: str = "",
    judge_url: str = "",
    judge_timeout_s: float = 1.0,
) -> Part:
    """A rollout flow of `groups` Distinct groups whose items are `{seed}-{n}` (with `grader`:
    soak.graded's, scored by code_exec's sandbox or llm_judge's judge at `judge_url`); its journal is
    `work/journals/{seed}.txt` (every group it finished)."""
    journal = work / "journals" / f"{seed}.txt"
    journal.parent.mkdir(parents=True, exist_ok=True)
    command = [
        str(BIN / "clotho"),
        "rollout",
        "--env",
        "soak.graded:Graded" if grader else "soak.groups:Distinct",
        "--run",
        run_url,
        "--server",
        server_url,
        "--tokenizer",
        str(model),
        "--groups",
        str(groups),
        "--max-concurrent-groups",
        str(lanes),
        "--task-run-s",
        str(task_run_s),
        "--shard-max-age-s",
        str(shard_max_age_s),
        "--set",
        f"seed={seed}",
        "--set",
        f"group_size={group_size}",
        "--set",
        f"delay_s={delay_s}",
        "--set",
        f"sample_tokens={sample_tokens}",
        "--set",
        f"journal={journal}",
    ]
    if grader:
        command += [
            "--set",
            f"grader={grader}",
            "--set",
            f"judge_url={judge_url}",
            "--set",
            f"judge_timeout_s={judge_timeout_s}",
        ]
    part = Part(name, command, env=env, log_path=work / "logs" / f"{name}-{seed}.log")
    part.journal, part.seed, part.groups_asked = journal, seed, groups
    return part

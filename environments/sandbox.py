"""Runs an untrusted Python program in its own bounded, isolated process: code_exec's sandbox.

Isolation levels, strongest first; `isolation()` names the one this machine gets (the first whose
probe runs a program), `run_python(..., level=...)` picks one:

    bwrap    bubblewrap: new mount, pid, net, ipc, uts namespaces. The filesystem is /usr and the
             interpreter read-only, an empty private /tmp, /proc, /dev and the work directory as
             /sandbox; no /etc, /home, /root or project files.
    unshare  util-linux unshare: new net, pid, ipc, uts namespaces over the host's filesystem.
    rlimits  resource limits and a process group only.

Under every level the program gets: rlimits (address space, CPU seconds, processes, file size,
open files, no core) set by `prlimit`, so nothing runs between fork and exec in this process; an
empty work directory as cwd; env = PATH only; stdin at EOF; stdout and stderr in unlinked files
bounded by the file-size limit; a wall-clock limit after which its process group is killed (a
pid namespace dies with it). Run as root, the program is also a fresh unprivileged uid (no
capabilities, no_new_privs): RLIMIT_NPROC counts per real uid and root is exempt, and a uid of its
own keeps one sandbox's fork bomb from using up its siblings' process budget. The fallbacks drop
the uid only when other users can read the interpreter (a pyenv under /root they cannot).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

LEVELS = ("bwrap", "unshare", "rlimits")
PATH = "/usr/bin:/bin"
INTERPRETER = os.path.realpath(sys.executable)  # the base interpreter behind a venv's symlink
_AS_ROOT = os.geteuid() == 0


class Limits(BaseModel):
    """What one program may use before the sandbox stops it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_seconds: int = Field(default=2, ge=1, description="CPU time (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later).")
    wall_seconds: float = Field(default=6.0, gt=0, description="Wall-clock time before the whole process group is killed.")
    memory_mb: int = Field(default=256, ge=32, description="Address space of each process (RLIMIT_AS).")
    processes: int = Field(default=16, ge=2, description="Processes and threads of the program's uid (RLIMIT_NPROC; as root only).")
    file_mb: int = Field(default=8, ge=1, description="Largest file it may write, stdout and stderr included (RLIMIT_FSIZE).")
    open_files: int = Field(default=64, ge=8, description="Open file descriptors (RLIMIT_NOFILE).")
    output_bytes: int = Field(default=65_536, ge=256, description="The last this many bytes of stdout and of stderr are returned.")


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int  # a program killed by signal N: 128 + N under bwrap and unshare, -N under rlimits
    stdout: str
    stderr: str
    timed_out: bool  # the wall-clock limit ran out and the sandbox killed it
    killed: str | None  # why it stopped other than exiting: wall_time, cpu_time, memory or "signal NAME"
    isolation: str
    seconds: float


def _interpreter_world_readable() -> bool:
    path = Path(INTERPRETER)
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [*path.parents, path])


def _bwrap_arguments(workdir: str, drop_uid: bool) -> list[str]:
    arguments = ["bwrap", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):  # merged-/usr symlinks or real directories
        if os.path.islink(top):
            arguments += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            arguments += ["--ro-bind", top, top]
    prefix = Path(sys.base_prefix)
    if not prefix.is_relative_to("/usr"):  # e.g. /root/.pyenv/...: its parents readable, nothing else
        for parent in reversed(prefix.parents[:-1]):
            arguments += ["--perms", "0755", "--dir", str(parent)]
        arguments += ["--ro-bind", str(prefix), str(prefix)]
    arguments += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", workdir, "/sandbox", "--chdir", "/sandbox"]
    arguments += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    arguments += ["--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", PATH]
    # As root it stays in the host's user namespace, so the uid it drops to is a real one.
    arguments += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if drop_uid else ["--unshare-user"]
    return arguments + ["--"]


def _command(level: str, workdir: str, limits: Limits, uid: int | None) -> list[str]:
    rlimits = ["prlimit", f"--as={limits.memory_mb << 20}", f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
               f"--fsize={limits.file_mb << 20}", f"--nofile={limits.open_files}", "--core=0"]  # fmt: skip
    if uid is not None:  # RLIMIT_NPROC of a non-root caller would count all of its own processes
        rlimits.append(f"--nproc={limits.processes}")
    drop = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                                   "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]  # fmt: skip
    inner = [*rlimits, "--", *drop, INTERPRETER, "-I", "-X", "utf8", "main.py"]
    if level == "bwrap":
        return _bwrap_arguments(workdir, uid is not None) + inner
    if level == "unshare":
        user = [] if _AS_ROOT else ["--user", "--map-root-user"]
        # util-linux 2.38's unshare exits 0 or 1 when its child dies of a signal; sh says 128 + N.
        reaper = ["/bin/sh", "-c", '"$@"; exit $?', "sh"]
        return ["unshare", *user, "--net", "--pid", "--fork", "--kill-child", "--ipc", "--uts", "--mount-proc", "--", *reaper, *inner]
    return inner


def _tail(file, limit: int) -> str:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - limit))
    return file.read().decode("utf-8", errors="replace")


def _why_killed(level: str, exit_code: int, timed_out: bool, stderr: str) -> str | None:
    if timed_out:
        return "wall_time"
    number = -exit_code if exit_code < 0 else exit_code - 128 if level != "rlimits" and exit_code > 128 else None
    if number == signal.SIGXCPU:
        return "cpu_time"
    if "MemoryError" in stderr and exit_code != 0:
        return "memory"
    return f"signal {signal.Signals(number).name}" if number in signal.valid_signals() else None


def run_python(source: str, limits: Limits = Limits(), level: str | None = None) -> SandboxResult:
    """Runs `source` as main.py in an empty directory under isolation `level` (default: the
    strongest this machine has); never raises for anything the program does."""
    level = level or isolation()
    if level not in LEVELS:
        raise ValueError(f"level: {level!r} is not one of {LEVELS}")
    uid = 1_000_000 + secrets.randbelow(1 << 30) if drops_uid(level) else None
    workdir = tempfile.mkdtemp(prefix="clotho-sandbox-")
    try:
        Path(workdir, "main.py").write_text(source)
        if uid is not None:
            os.chown(workdir, uid, uid)
        with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
            started = time.perf_counter()
            process = subprocess.Popen(
                _command(level, workdir, limits, uid), cwd=workdir, env={"PATH": PATH}, stdin=subprocess.DEVNULL,
                stdout=stdout, stderr=stderr, start_new_session=True,
            )  # fmt: skip
            try:
                process.wait(timeout=limits.wall_seconds)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # a pid namespace dies with its first process
                process.wait()
            seconds = time.perf_counter() - started
            if level == "rlimits" and uid is not None:  # no pid namespace: kill whatever its uid left behind
                sweep = "import os, signal; os.kill(-1, signal.SIGKILL)"  # -1: every process of the uid but the caller
                subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", INTERPRETER, "-I", "-c", sweep],
                               env={"PATH": PATH}, capture_output=True, check=False)  # fmt: skip
            out, err = _tail(stdout, limits.output_bytes), _tail(stderr, limits.output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    code = process.returncode
    return SandboxResult(code, out, err, timed_out, _why_killed(level, code, timed_out, err), level, seconds)


def drops_uid(level: str) -> bool:
    """Whether programs under `level` run as a fresh unprivileged uid of their own."""
    return _AS_ROOT and (level == "bwrap" or _interpreter_world_readable())


@functools.cache
def available(level: str) -> bool:
    """Whether `level` runs a program on this machine (probed once per process)."""
    tools = {"bwrap": ["bwrap", "prlimit"], "unshare": ["unshare", "prlimit"], "rlimits": ["prlimit"]}[level]
    if any(shutil.which(tool) is None for tool in tools + (["setpriv"] if _AS_ROOT else [])):
        return False
    result = run_python("print('ok')", level=level)
    return result.exit_code == 0 and result.stdout == "ok\n"


def isolation() -> str:
    """The strongest level that works here: bwrap, else unshare, else rlimits."""
    for level in LEVELS:
        if available(level):
            return level
    raise RuntimeError("the sandbox cannot run a program here: install util-linux (prlimit, setpriv) and bubblewrap")

"""Runs an untrusted Python program in its own bounded, isolated process: code_exec's sandbox.

Isolation levels, strongest first; `isolation()` names the one this machine gets (the first whose
probe runs a program), `run_python(..., level=...)` picks one:

    bwrap    bubblewrap: new mount, pid, net, ipc, uts namespaces. The filesystem is /usr and the
             interpreter read-only, /proc, /dev, and two private tmpfs of `file_mb` each: /tmp and
             the work directory /sandbox (main.py copied in), so what it writes stays in bounded
             memory, never on the host's disk; no /etc, /home, /root or project files. A seccomp
             filter (x86_64 and aarch64) refuses new user namespaces (unshare/clone with
             CLONE_NEWUSER; clone3 answers ENOSYS so libc falls back to clone): in one the program
             would be root again and could mount a tmpfs no rlimit bounds, or reach kernel code
             only root reaches.
    unshare  util-linux unshare: new net, pid, ipc, uts namespaces over the host's filesystem; no
             seccomp filter, and its work directory is on the host's disk.
    rlimits  resource limits and a process group only.

Under every level the program gets: rlimits (address space, CPU seconds, processes, file size,
open files, no core) set by `prlimit`, so nothing runs between fork and exec in this process; an
empty work directory as cwd; env = PATH only; stdin at EOF; stdout and stderr in unlinked files
bounded by the file-size limit; a wall-clock limit after which its process group is killed (a
pid namespace dies with it). The result says the CPU time it used and, when the wall-clock limit
killed it, whether it was starved (`infra`: it wanted a CPU the loaded machine did not give it,
STARVED_SHARE), a failure of the machine rather than of the program. Run as root, the program is also a fresh unprivileged uid (no
capabilities, no_new_privs): RLIMIT_NPROC counts per real uid and root is exempt, and a uid of its
own keeps one sandbox's fork bomb from using up its siblings' process budget. The fallbacks drop
the uid only when other users can read the interpreter (a pyenv under /root they cannot).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import platform
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

LEVELS = ("bwrap", "unshare", "rlimits")
PATH = "/usr/bin:/bin"
INTERPRETER = os.path.realpath(sys.executable)  # the base interpreter behind a venv's symlink
_AS_ROOT = os.geteuid() == 0


class Limits(BaseModel):
    """What one program may use before the sandbox stops it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_seconds: int = Field(
        default=2, ge=1, description="CPU time (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later)."
    )
    wall_seconds: float = Field(
        default=6.0, gt=0, description="Wall-clock time before the whole process group is killed."
    )
    memory_mb: int = Field(default=256, ge=32, description="Address space of each process (RLIMIT_AS).")
    processes: int = Field(
        default=16, ge=2, description="Processes and threads of the program's uid (RLIMIT_NPROC; as root only)."
    )
    file_mb: int = Field(
        default=8,
        ge=1,
        description="Largest file it may write, stdout and stderr included (RLIMIT_FSIZE); under bwrap also the size of "
        "its work directory and of its /tmp, all files together.",
    )
    open_files: int = Field(default=64, ge=8, description="Open file descriptors (RLIMIT_NOFILE).")
    output_bytes: int = Field(
        default=65_536, ge=256, description="The last this many bytes of stdout and of stderr are returned."
    )


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int  # a program killed by signal N: 128 + N under bwrap and unshare, -N under rlimits
    stdout: str
    stderr: str
    timed_out: bool  # the wall-clock limit ran out and the sandbox killed it
    killed: str | None  # why it stopped other than exiting: wall_time, cpu_time, memory or "signal NAME"
    isolation: str
    seconds: float
    cpu_seconds: float = 0.0  # CPU time the program's processes used (exact at a wall kill, else to SAMPLE_S)
    waited_seconds: float = 0.0  # time they were ready to run and got no CPU (measured at a wall kill)
    infra: bool = False  # killed on wall time for want of a CPU, not for what it did (starved)


# A program killed on wall time that used less than its CPU budget and spent at least this share
# of the wall time ready to run without a CPU was starved by the machine (a loaded host), not slow
# or stuck by itself (a sleep, a wait, a deadlock: those wait on nothing the machine owes them).
STARVED_SHARE = 0.25
SAMPLE_S = 0.1  # how often a running program's CPU time is read (~1 ms a read here, /proc of 120 processes)
_TICKS = os.sysconf("SC_CLK_TCK")


def tree_usage(root: int) -> tuple[float, float]:
    """CPU seconds used by `root` and its descendants (those reaped included, through their
    parents' counts) and seconds they spent runnable without a CPU (/proc schedstat), read while
    they run. A sandbox's processes in their own pid namespace are visible here by host pids."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # ended while we looked
            continue
        pid = int(stat.parent.name)
        parents[pid], stats[pid] = int(fields[1]), fields
    tree, grew = {root}, True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= found
        grew = bool(found)
    cpu = waited = 0.0
    for pid in tree & stats.keys():
        utime, stime, cutime, cstime = (int(value) for value in stats[pid][11:15])
        cpu += (utime + stime + cutime + cstime) / _TICKS
        with contextlib.suppress(OSError, ValueError, IndexError):
            waited += int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    return cpu, waited


def _interpreter_world_readable() -> bool:
    path = Path(INTERPRETER)
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [*path.parents, path])


# Audit architecture and the numbers of clone, unshare and clone3, per machine.
_SYSCALLS = {"x86_64": (0xC000003E, 56, 272, 435), "aarch64": (0xC00000B7, 220, 97, 435)}
_CLONE_NEWUSER = 0x10000000


def seccomp_filter(machine: str = platform.machine()) -> bytes | None:
    """A classic-BPF seccomp program, as `bwrap --seccomp FD` loads it, that refuses new user
    namespaces and kills any call made through another ABI (i386 or x32 numbers on x86_64 would
    slip past the numbers checked); None on a machine it has no syscall numbers for."""
    if machine not in _SYSCALLS:
        return None
    arch, clone, unshare, clone3 = _SYSCALLS[machine]
    load, equal, at_least, any_bit, give = (
        0x20,
        0x15,
        0x35,
        0x45,
        0x06,
    )  # BPF_LD|W|ABS, BPF_JMP|JEQ|JGE|JSET|K, BPF_RET|K
    allow, kill, refuse = 0x7FFF0000, 0x80000000, 0x00050000  # SECCOMP_RET_ALLOW, _KILL_PROCESS, _ERRNO | errno
    steps = [  # (label, code, k, jump if true, jump if false); seccomp_data: nr at 0, arch at 4, args[0] at 16
        ("", load, 4, None, None),
        ("", equal, arch, None, "kill"),
        ("", load, 0, None, None),
        ("", at_least, 0x40000000, "kill", None),  # x32: 0x40000000 | nr
        ("", equal, clone3, "no clone3", None),  # its flags sit behind a pointer a filter cannot read
        ("", equal, unshare, "flags", None),
        ("", equal, clone, "flags", None),
        ("", give, allow, None, None),
        ("flags", load, 16, None, None),
        ("", any_bit, _CLONE_NEWUSER, "refuse", None),
        ("", give, allow, None, None),
        ("refuse", give, refuse | errno.EPERM, None, None),
        ("no clone3", give, refuse | errno.ENOSYS, None, None),
        ("kill", give, kill, None, None),
    ]
    at = {label: index for index, (label, *_) in enumerate(steps) if label}

    def hop(index: int, label: str | None) -> int:  # a jump counts the instructions it skips
        return 0 if label is None else at[label] - index - 1

    return b"".join(
        struct.pack("=HBBI", code, hop(i, yes), hop(i, no), k) for i, (_, code, k, yes, no) in enumerate(steps)
    )


def _bwrap_arguments(limits: Limits, drop_uid: bool, source_fd: int, seccomp_fd: int | None) -> list[str]:
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
    size = str(limits.file_mb << 20)
    arguments += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp"]
    # Created by bwrap before the uid drop: open to that uid, which unlinks main.py (code_exec's harness does).
    arguments += [
        "--perms",
        "0777",
        "--size",
        size,
        "--tmpfs",
        "/sandbox",
        "--perms",
        "0644",
        "--file",
        str(source_fd),
        "/sandbox/main.py",
    ]
    arguments += [
        "--chdir",
        "/sandbox",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]
    arguments += ["--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", PATH]
    if seccomp_fd is not None:
        arguments += ["--seccomp", str(seccomp_fd)]
    # As root it stays in the host's user namespace, so the uid it drops to is a real one.
    arguments += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if drop_uid else ["--unshare-user"]
    return arguments + ["--"]


def _command(level: str, limits: Limits, uid: int | None, fds: dict[str, int]) -> list[str]:
    rlimits = [
        "prlimit",
        f"--as={limits.memory_mb << 20}",
        f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
        f"--fsize={limits.file_mb << 20}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]
    if uid is not None:  # RLIMIT_NPROC of a non-root caller would count all of its own processes
        rlimits.append(f"--nproc={limits.processes}")
    drop = (
        []
        if uid is None
        else [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ]
    )
    inner = [*rlimits, "--", *drop, INTERPRETER, "-I", "-X", "utf8", "main.py"]
    if level == "bwrap":
        return _bwrap_arguments(limits, uid is not None, fds["source"], fds.get("seccomp")) + inner
    if level == "unshare":
        user = [] if _AS_ROOT else ["--user", "--map-root-user"]
        # util-linux 2.38's unshare exits 0 or 1 when its child dies of a signal; sh says 128 + N.
        reaper = ["/bin/sh", "-c", '"$@"; exit $?', "sh"]
        return [
            "unshare",
            *user,
            "--net",
            "--pid",
            "--fork",
            "--kill-child",
            "--ipc",
            "--uts",
            "--mount-proc",
            "--",
            *reaper,
            *inner,
        ]
    return inner


def _readable(cleanup: contextlib.ExitStack, data: bytes) -> int:
    """A file descriptor open on an unlinked file holding `data`, read from its start."""
    file = cleanup.enter_context(tempfile.TemporaryFile())
    file.write(data)
    file.flush()
    file.seek(0)
    return file.fileno()


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


DEFAULT_LIMITS = Limits()


def run_python(source: str, limits: Limits = DEFAULT_LIMITS, level: str | None = None) -> SandboxResult:
    """Runs `source` as main.py in an empty directory under isolation `level` (default: the
    strongest this machine has); never raises for anything the program does."""
    level = level or isolation()
    if level not in LEVELS:
        raise ValueError(f"level: {level!r} is not one of {LEVELS}")
    uid = 1_000_000 + secrets.randbelow(1 << 30) if drops_uid(level) else None
    with contextlib.ExitStack() as cleanup:
        stdout, stderr = (cleanup.enter_context(tempfile.TemporaryFile()) for _ in range(2))
        if level == "bwrap":  # main.py and the seccomp program reach bwrap as file descriptors
            fds = {"source": _readable(cleanup, source.encode())}
            if (program := seccomp_filter()) is not None:
                fds["seccomp"] = _readable(cleanup, program)
            cwd = "/"
        else:
            fds, cwd = {}, tempfile.mkdtemp(prefix="clotho-sandbox-")
            cleanup.callback(shutil.rmtree, cwd, ignore_errors=True)
            Path(cwd, "main.py").write_text(source)
            if uid is not None:
                os.chown(cwd, uid, uid)
        started = time.perf_counter()
        process = subprocess.Popen(
            _command(level, limits, uid, fds),
            cwd=cwd,
            env={"PATH": PATH},
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            pass_fds=tuple(fds.values()),
        )
        cpu, waited = _ended(process, limits.wall_seconds)
        timed_out = cpu is None
        if cpu is None:
            cpu, waited = tree_usage(process.pid)  # before the kill: what it got of the CPU, and what it waited for
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # a pid namespace dies with its first process
            process.wait()
        seconds = time.perf_counter() - started
        if level == "rlimits" and uid is not None:  # no pid namespace: kill whatever its uid left behind
            sweep = "import os, signal; os.kill(-1, signal.SIGKILL)"  # -1: every process of the uid but the caller
            subprocess.run(
                ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", INTERPRETER, "-I", "-c", sweep],
                env={"PATH": PATH},
                capture_output=True,
                check=False,
            )
        if uid is not None:
            _wait_until_gone(uid)
        out, err = _tail(stdout, limits.output_bytes), _tail(stderr, limits.output_bytes)
    code = process.returncode
    starved = timed_out and cpu < limits.cpu_seconds and waited >= STARVED_SHARE * limits.wall_seconds
    return SandboxResult(
        code, out, err, timed_out, _why_killed(level, code, timed_out, err), level, seconds, cpu, waited, starved
    )


def _ended(process: subprocess.Popen, timeout_s: float) -> tuple[float | None, float]:
    """Waits up to `timeout_s` for `process`. Once it ended: its CPU seconds and the seconds it
    waited for a CPU (the last of tree_usage, read every SAMPLE_S while it ran: a pid namespace's
    init does not pass its children's times up to wait4) and its exit code in returncode; (None,
    0.0) when it is still running."""
    deadline, pause, sampled_at = time.monotonic() + timeout_s, 0.001, time.monotonic()
    cpu = waited = 0.0
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return max(cpu, usage.ru_utime + usage.ru_stime), waited
        now = time.monotonic()
        if now >= deadline:
            return None, 0.0
        if now - sampled_at >= SAMPLE_S:
            cpu, waited = tree_usage(process.pid)
            sampled_at = now
        time.sleep(min(pause, max(0.0, deadline - now)))
        pause = min(pause * 2, 0.02)


def _wait_until_gone(uid: int, timeout_s: float = 5.0) -> None:
    """Returns once no process of `uid` is left: the kernel tears a dead pid namespace down after
    its first process exits, not before, so a fork bomb's processes may outlive it by a moment."""
    marker = f"\t{uid}\t"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = False
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                uids = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
            except (OSError, StopIteration):  # it ended while we looked
                continue
            if marker in uids + "\t":
                left = True
                break
        if not left:
            return
        time.sleep(0.01)
    log.warning("sandbox uid %d still has processes %.0f s after its program ended", uid, timeout_s)


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

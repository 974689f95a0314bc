"""Nobody let in, the sandbox: a model's code tries to escape code_exec's sandbox through the
environment's own scoring path.

Each escape is the code a model could answer with, a function `attack()` that returns
'contained' or what it got hold of, scored by CodeExec.verdict against the hidden assert
`attack() == 'contained'` (score 1.0: contained), in a scoring process started, like a rollout flow,
with secrets in its environment, a secret file and a connection open (tests.reliability.sandbox_attacks).
The same attack run outside the sandbox (the positive control) must get hold of something, so a test
cannot pass because its attack was broken; and what the host sees (files, listeners, sleepers,
processes) is checked by the host, not only by the sandboxed code's word.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from environments.sandbox import Limits, drops_uid
from tests.reliability.sandbox_attacks import (
    AS_ROOT,
    CLONE_NUMBER,
    LEVEL,
    REPO,
    SAFE_TO_BROADCAST,
    host_address,
    needs_bwrap,
)

# ---------------------------------------------------------------------------------------------
# The host's side: listeners, sleepers, secrets, and a watch on the process table.


class Listeners:
    """TCP and UDP on every address, an abstract and a filesystem unix socket; records what
    arrives (the attack sends who it is), in a thread, until closed."""

    def __init__(self, directory: Path, nonce: str):
        self.arrived: list[tuple[str, str]] = []
        self.tcp = socket.create_server(("0.0.0.0", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("0.0.0.0", 0))
        self.abstract_name = f"\0clotho-security-{nonce}"
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind(self.abstract_name)
        self.file_name = str(directory / "listener.sock")
        self.file = socket.socket(socket.AF_UNIX)
        self.file.bind(self.file_name)
        os.chmod(self.file_name, 0o777)  # anyone may connect: only the sandbox's filesystem keeps it out
        for listener in (self.tcp, self.abstract, self.file):
            listener.listen()
        self.selector = selectors.DefaultSelector()
        for channel, listener in (
            ("tcp", self.tcp),
            ("udp", self.udp),
            ("abstract unix", self.abstract),
            ("file unix", self.file),
        ):
            listener.setblocking(False)
            self.selector.register(listener, selectors.EVENT_READ, channel)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.selector.select(timeout=0.1):
                channel, listener = key.data, key.fileobj
                try:
                    if channel == "udp":
                        data = listener.recv(4096)
                    else:
                        connection, _ = listener.accept()
                        connection.settimeout(2)
                        with connection:
                            data = connection.recv(4096)
                except OSError:
                    continue
                self.arrived.append((channel, data.decode(errors="replace")))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for listener in (self.tcp, self.udp, self.abstract, self.file):
            listener.close()


class ProcessWatch:
    """How many processes carry each marker on their command line: the most seen, and now."""

    def __init__(self, markers: list[str]):
        self.markers, self.most = markers, dict.fromkeys(markers, 0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def count(self) -> dict[str, int]:
        counts = dict.fromkeys(self.markers, 0)
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                text = cmdline.read_bytes()
            except OSError:
                continue
            for marker in self.markers:
                counts[marker] += marker.encode() in text
        return counts

    def _watch(self) -> None:
        while not self.stop.is_set():
            for marker, seen in self.count().items():
                self.most[marker] = max(self.most[marker], seen)
            time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)


@pytest.fixture(scope="module")
def escapes(tiny_model_dir):
    """Runs every attack (and its control) in one scoring process; what it reports and what the
    host saw."""
    nonce = secrets.token_hex(6)
    host_dir = Path(tempfile.mkdtemp(prefix="clotho-security-"))
    host_dir.chmod(0o777)  # writable by anyone: only the sandbox's own filesystem keeps the program out
    (host_dir / "existing.txt").write_text("untouched")
    (host_dir / "existing.txt").chmod(0o666)
    control_dir = host_dir / "control"
    control_dir.mkdir()
    secret = f"sandbox-SECRET-{nonce}"
    secret_file = host_dir / "credentials"
    secret_file.write_text(f"[default]\naws_secret_access_key = {secret}\n")
    secret_file.chmod(0o644)  # readable by anyone: only the sandbox's own filesystem keeps it out
    sleepers = {"sandbox": sleeper(), "control": sleeper()}
    listeners = Listeners(host_dir, nonce)
    markers = {"bomb": f"clotho-bomb-{nonce}", "linger": f"clotho-linger-{nonce}"}
    watch = ProcessWatch(list(markers.values()))
    received = []
    previous = signal.signal(signal.SIGUSR2, lambda number, frame: received.append(number))
    plan = {
        "nonce": nonce,
        "secret": secret,
        "tokenizer": str(tiny_model_dir),
        "host_dir": str(host_dir),
        "control_dir": str(control_dir),
        "test_pid": os.getpid(),
        "secret_paths": [
            str(secret_file),
            str(REPO / "pyproject.toml"),
            str(REPO / ".git" / "config"),
            str(Path.home() / ".aws" / "credentials"),
            "/etc/passwd",
            "/etc/shadow",
        ],
        "sleepers": {who: process.pid for who, process in sleepers.items()},
        "hosts": ["127.0.0.1"] + ([host_address()] if host_address() else []),
        "tcp_port": listeners.tcp.getsockname()[1],
        "udp_port": listeners.udp.getsockname()[1],
        "abstract_socket": listeners.abstract_name,
        "file_socket": listeners.file_name,
        "markers": markers,
    }
    environment = {**os.environ, "CLOTHO_API_KEY": secret, "AWS_SECRET_ACCESS_KEY": secret}
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.reliability.sandbox_attacks"],
            input=json.dumps(plan),
            cwd=REPO,
            env=environment,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"the scoring process failed ({done.returncode}):\n{done.stderr[-4000:]}"
        report = json.loads(done.stdout.strip().splitlines()[-1])
        time.sleep(0.5)  # let the listeners take in anything still in flight
        report |= {
            "seconds": time.monotonic() - started,
            "arrived": list(listeners.arrived),
            "test_signalled": list(received),
            "sleepers_alive": {who: process.poll() is None for who, process in sleepers.items()},
            "markers_most": {name: watch.most[marker] for name, marker in markers.items()},
            "markers_now": {name: watch.count()[marker] for name, marker in markers.items()},
            "written": {who: sorted(str(p) for p in written_by(plan, who)) for who in ("sandbox", "control")},
            "existing": (host_dir / "existing.txt").read_text(),
        }
        yield report
    finally:
        signal.signal(signal.SIGUSR2, previous)
        watch.close()
        listeners.close()
        for process in sleepers.values():
            process.kill()
            process.wait()
        for who in ("sandbox", "control"):
            for path in written_by(plan, who):
                path.unlink()
        shutil.rmtree(host_dir, ignore_errors=True)


def written_by(plan: dict, who: str) -> list[Path]:
    """The files the write attack aimed at the host that exist."""
    name = f"escaped-{who}-{plan['nonce']}"
    places = [
        Path(plan["host_dir"]),
        Path(plan["control_dir"]),
        Path("/tmp"),
        Path("/dev/shm"),
        REPO / ".clotho",
        Path.home(),
        Path("/"),
    ]
    return [place / name for place in places if (place / name).exists()]


def assert_contained(escapes: dict, name: str) -> None:
    outcome = escapes["sandbox"][name]
    assert outcome["score"] == 1.0, f"attack {name!r} was not contained under {LEVEL}: {outcome.get('shown')}"
    assert outcome["seconds"] < Limits().wall_seconds + 5, outcome


def assert_control_escaped(escapes: dict, name: str, *expected: str) -> None:
    """Outside the sandbox the same code gets hold of what it aims at: the attack works."""
    shown = escapes["controls"][name]
    assert shown.startswith("escaped"), (
        f"attack {name!r} gets nothing even without the sandbox (a broken attack): {shown}"
    )
    for part in expected:
        assert part in shown, f"attack {name!r} outside the sandbox missed {part!r}: {shown}"


# ---------------------------------------------------------------------------------------------
# Sandbox escapes


def test_the_parents_secrets_are_out_of_reach_of_its_environment_and_proc(escapes) -> None:
    """os.environ, /proc/self, /proc/<ppid>/environ, /proc/self/../<pid>, every /proc/<pid>/environ."""
    assert_control_escaped(escapes, "environment", "/environ")  # the scoring process's, through /proc
    assert_contained(escapes, "environment")


@needs_bwrap
def test_the_hosts_files_are_out_of_reach(escapes) -> None:
    """A world-readable secret file, the repo's files, ~/.aws/credentials, /etc; also through
    /proc/self/root, /proc/1/root and /proc/self/cwd/.."""
    assert_control_escaped(escapes, "files", "credentials", "pyproject.toml", "/etc/passwd")
    assert_contained(escapes, "files")


def test_the_parents_open_file_descriptors_are_not_inherited(escapes) -> None:
    assert_control_escaped(escapes, "descriptors", "holds the secret")  # a child given the fds reads them
    assert_contained(escapes, "descriptors")


@needs_bwrap
def test_writes_outside_its_directory_never_reach_the_host(escapes) -> None:
    """A world-writable host directory and file, /tmp, /dev/shm, the repo, $HOME, .., a symlink."""
    assert_control_escaped(escapes, "writes", "existing.txt", "link/")
    assert escapes["written"]["control"], "the control wrote nothing on the host"
    assert_contained(escapes, "writes")
    assert escapes["written"]["sandbox"] == [] and escapes["existing"].startswith("untouched")
    assert "sandbox" not in escapes["existing"]


@needs_bwrap
def test_what_it_writes_in_its_own_directory_is_bounded(escapes) -> None:
    """One file is bounded by RLIMIT_FSIZE; many files together by the size of its tmpfs."""
    assert_control_escaped(escapes, "fill", f"wrote {4 * Limits().file_mb} MB")  # the host's disk takes them all
    assert_contained(escapes, "fill")


@pytest.mark.skipif(LEVEL == "rlimits", reason="rlimits alone keeps the host's network")
def test_no_connection_or_datagram_leaves_the_sandbox(escapes) -> None:
    """TCP and UDP to loopback and to this machine's address, abstract and filesystem unix sockets,
    the internet, DNS."""
    assert_control_escaped(escapes, "network", "tcp 127.0.0.1", "unix '\\x00clotho-security")
    arrived = escapes["arrived"]
    assert {channel for channel, who in arrived if who == "control"} >= {"tcp", "udp", "abstract unix", "file unix"}, (
        arrived
    )
    assert_contained(escapes, "network")
    assert [(channel, who) for channel, who in arrived if who != "control"] == []


@pytest.mark.skipif(
    not SAFE_TO_BROADCAST, reason=f"{LEVEL} runs the program as root here: kill(-1) would reach the host"
)
def test_signals_never_reach_a_process_outside(escapes) -> None:
    """SIGKILL to a sleeper the test started, SIGUSR1 to the scoring process, SIGUSR2 to the test,
    SIGKILL to every process it may signal (kill -1)."""
    assert_control_escaped(escapes, "signals", "signal 9")
    assert not escapes["sleepers_alive"]["control"], "the control's SIGKILL did not reach its sleeper"
    assert_contained(escapes, "signals")
    assert escapes["sleepers_alive"]["sandbox"] and escapes["signalled"] == [] and escapes["test_signalled"] == []


@needs_bwrap
@pytest.mark.skipif(
    CLONE_NUMBER < 0, reason=f"no seccomp filter for {platform.machine()} (environments.sandbox._SYSCALLS)"
)
def test_no_user_namespace_makes_it_root_again(escapes) -> None:
    """unshare(CLONE_NEWUSER), clone(CLONE_NEWUSER), unshare(1): root in a namespace of its own
    could mount a tmpfs no rlimit bounds."""
    assert_control_escaped(escapes, "user_namespace", "unshare(CLONE_NEWUSER)", "clone(CLONE_NEWUSER)")
    assert_contained(escapes, "user_namespace")


@pytest.mark.skipif(not drops_uid(LEVEL), reason=f"{LEVEL} keeps this machine's uid here")
def test_it_runs_without_privileges(escapes) -> None:
    if AS_ROOT:
        assert_control_escaped(escapes, "privilege", "setuid(0)")
    assert_contained(escapes, "privilege")


def test_nothing_it_starts_outlives_the_scoring_run(escapes) -> None:
    """A double-forked, setsid daemon sleeping 30 s is gone when the verdict returns."""
    assert escapes["markers_most"]["linger"] >= 1, "the daemon never started: the attack is broken"
    assert_contained(escapes, "linger")
    assert escapes["markers_now"]["linger"] == 0


@pytest.mark.skipif(
    not drops_uid(LEVEL), reason=f"{LEVEL} runs the program as this (root) user, whom RLIMIT_NPROC exempts"
)
def test_a_fork_bomb_scores_zero_in_bounded_time_and_spares_its_sibling(escapes) -> None:
    bomb, sibling = escapes["bomb"], escapes["sibling"]
    assert escapes["markers_most"]["bomb"] > 1, "the bomb never forked: the attack is broken"
    assert bomb["score"] == 0.0 and bomb["seconds"] < Limits().wall_seconds + 5, bomb
    assert sibling["score"] == 1.0, f"a sandbox run beside the bomb failed: {sibling}"
    assert escapes["markers_now"]["bomb"] == 0, "the bomb's processes outlived its run"


def test_a_candidate_cannot_forge_its_passing_count(escapes) -> None:
    assert escapes["forged"]["score"] == 0.0, "a candidate that solves nothing scored by forging the count line"


def test_an_answer_that_equals_everything_scores_zero(escapes) -> None:
    assert escapes["always_equal"]["score"] == 0.0, "add() returning an object equal to anything passed the asserts"


def test_the_seccomp_filter_is_valid_classic_bpf() -> None:
    """8-byte instructions, every jump landing inside the program, the last one a return."""
    from environments.sandbox import seccomp_filter

    for machine in ("x86_64", "aarch64"):
        program = seccomp_filter(machine)
        assert program and len(program) % 8 == 0
        steps = [
            (int.from_bytes(program[i : i + 2], sys.byteorder), program[i + 2], program[i + 3])
            for i in range(0, len(program), 8)
        ]
        for index, (code, yes, no) in enumerate(steps):
            if code & 0x07 == 0x05:  # a jump
                assert index + 1 + max(yes, no) < len(steps)
        assert steps[-1][0] == 0x06  # a return
    assert seccomp_filter("riscv64") is None

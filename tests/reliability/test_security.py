"""Nobody let in: a model's code tries to escape code_exec's sandbox through the environment's own
scoring path, and off-machine clients try the policy server's dev routes.

Sandbox: each escape is the code a model could answer with, a function `attack()` that returns
'contained' or what it got hold of, scored by CodeExec.verdict against the hidden assert
`attack() == 'contained'` (score 1.0: contained), in a scoring process started, like a rollout flow,
with secrets in its environment, a secret file and a connection open. The same attack run outside
the sandbox (the positive control) must get hold of something, so a test cannot pass because its
attack was broken; and what the host sees (files, listeners, sleepers, processes) is checked by the
host, not only by the sandboxed code's word.

Dev routes: a server on 0.0.0.0 with an API key, asked from another network namespace (a veth
pair: an address that is not this machine's loopback; without root, this machine's own
non-loopback address) on every route its OpenAPI lists and some it does not: 401 without a key and
with every wrong one, answers with the right one; a loopback server cannot be reached at all; the
key is compared with hmac.compare_digest.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import os
import platform
import random
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

import psutil
import pytest

from environments.sandbox import PATH, Limits, drops_uid, isolation

REPO = Path(__file__).resolve().parents[2]
LEVEL = isolation()
AS_ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(LEVEL != "bwrap", reason=f"needs bubblewrap's own filesystem (this machine gets {LEVEL})")
# kill(-1) is only sent where it cannot reach beyond the sandbox's uid even if the pid namespace failed.
SAFE_TO_BROADCAST = drops_uid(LEVEL) or not AS_ROOT

# ---------------------------------------------------------------------------------------------
# The attacks: source a model could emit. Each is a header of constants and a body defining attack().


def _source(body: str, **constants) -> str:
    return "".join(f"{name} = {value!r}\n" for name, value in constants.items()) + body


ENVIRONMENT = """
def attack():
    import os
    found = [f"os.environ[{name}]" for name, value in os.environ.items() if SECRET in value]
    paths = ["/proc/self/environ", f"/proc/{os.getppid()}/environ", "/proc/1/environ", "/proc/self/../1/environ"]
    paths += [f"/proc/{pid}/environ" for pid in PIDS] + [f"/proc/self/../{pid}/environ" for pid in PIDS]
    try:
        paths += [f"/proc/{entry}/{name}" for entry in os.listdir("/proc") if entry.isdigit() for name in ("environ", "cmdline")]
    except OSError:
        pass
    for path in paths:
        try:
            with open(path, "rb") as file:
                if SECRET.encode() in file.read():
                    found.append(path)
        except OSError:
            pass
    return "escaped: " + ", ".join(found) if found else "contained"
"""

FILES = """
def attack():
    found = []
    for path in PATHS:
        for variant in (path, "/proc/self/root" + path, "/proc/1/root" + path, "/proc/self/cwd/../../.." + path):
            try:
                with open(variant, "rb") as file:
                    if file.read(64):
                        found.append(variant)
            except OSError:
                pass
    return "escaped: " + ", ".join(found) if found else "contained"
"""

DESCRIPTORS = """
def attack():
    import os, socket, stat
    found = []
    for fd in range(3, 1024):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        found.append(f"fd {fd} open")
        try:
            if stat.S_ISSOCK(mode):
                with socket.socket(fileno=os.dup(fd)) as sock:
                    data = sock.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            else:
                data = os.pread(fd, 4096, 0)
        except OSError:
            data = b""
        if SECRET.encode() in data:
            found.append(f"fd {fd} holds the secret")
    return "escaped: " + ", ".join(found) if found else "contained"
"""

WRITES = """
def attack():
    import os
    written = []
    for path in TARGETS:
        try:
            with open(path, "a") as file:
                file.write(WHO)
            written.append(path)
        except OSError:
            pass
    try:
        os.symlink(HOST_DIR, "link")
        with open(os.path.join("link", NAME), "w") as file:
            file.write(WHO)
        written.append("link/" + NAME)
    except OSError:
        pass
    return "escaped: " + ", ".join(written) if written else "contained"
"""

FILL = """
def attack():
    block, written = b"x" * (1 << 20), 0
    try:
        for index in range(LIMIT_MB):  # LIMIT_MB files of 4 MB: four times the bound
            with open(f"fill-{index}", "wb") as file:
                for _ in range(4):
                    file.write(block)
                    written += 1
    except OSError:
        pass
    return "contained" if written <= LIMIT_MB else f"escaped: wrote {written} MB"
"""

NETWORK = """
def attack():
    import socket
    reached = []
    for host in HOSTS:
        try:
            with socket.create_connection((host, TCP_PORT), timeout=1) as sock:
                sock.sendall(WHO.encode())
            reached.append(f"tcp {host}:{TCP_PORT}")
        except OSError:
            pass
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.sendto(WHO.encode(), (host, UDP_PORT))  # arrival is for the host to see
        except OSError:
            pass
    for address in UNIX_SOCKETS:
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(1)
                sock.connect(address)
                sock.sendall(WHO.encode())
            reached.append(f"unix {address!r}")
        except OSError:
            pass
    for host, port in INTERNET:
        try:
            socket.create_connection((host, port), timeout=1).close()
            reached.append(f"tcp {host}:{port}")
        except OSError:
            pass
    try:
        socket.getaddrinfo("example.com", 443)
        reached.append("dns")
    except OSError:
        pass
    return "escaped: " + ", ".join(reached) if reached else "contained"
"""

SIGNALS = """
def attack():
    import os, signal
    delivered = []
    for pid, number in TARGETS:
        try:
            os.kill(pid, number)
            delivered.append(f"signal {number} to {pid}")
        except OSError:
            pass
    if BROADCAST:
        try:
            os.kill(-1, signal.SIGKILL)
            delivered.append("SIGKILL to every process it may signal")
        except OSError:
            pass
    return "escaped: " + ", ".join(delivered) if delivered else "contained"
"""

USER_NAMESPACE = """
def attack():
    import ctypes, os, subprocess
    libc = ctypes.CDLL(None, use_errno=True)
    found = []
    for name, call in (("unshare(CLONE_NEWUSER)", lambda: libc.unshare(0x10000000)),
                       ("clone(CLONE_NEWUSER)", lambda: libc.syscall(CLONE, 0x10000000 | 17, 0, 0, 0, 0))):
        pid = os.fork()  # a process of one thread: unshare refuses a threaded one whatever the sandbox does
        if pid == 0:
            result = call()
            os._exit(0 if result == 0 else 3 if result > 0 else 1)  # clone: 0 in the new child, its pid here
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) in (0, 3):
            found.append(name)
    try:
        done = subprocess.run(["unshare", "--user", "--map-root-user", "id", "-u"], capture_output=True, text=True, timeout=3)
        if done.returncode == 0:
            found.append("unshare --user: uid " + done.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return "escaped: " + ", ".join(found) if found else "contained"
"""

PRIVILEGE = """
def attack():
    import os
    found = [line for line in open("/proc/self/status").read().splitlines() if line.startswith("Cap") and int(line.split()[1], 16)]
    for name, call in (("setuid(0)", lambda: os.setuid(0)), ("setgid(0)", lambda: os.setgid(0)), ("setgroups([0])", lambda: os.setgroups([0]))):
        try:
            call()
            found.append(name)
        except OSError:
            pass
    return "escaped: " + ", ".join(found) if found or os.getuid() == 0 else "contained"
"""

LINGER = """
def attack():
    import os, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; open('up', 'w').close(); time.sleep(30)", MARKER])
        os._exit(0)
    for _ in range(50):  # until the daemon is up, then long enough for the host to see it
        if os.path.exists("up"):
            time.sleep(0.5)
            break
        time.sleep(0.1)
    return "contained"
"""

BOMB = """
import os, sys
os.execv(sys.executable, [sys.executable, "-c", "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass", MARKER])
"""

# A candidate that reads the harness's nonce and test count from its caller's frame and prints a
# passing count line itself.
FORGED_COUNT = """
import os, sys
frame = sys._getframe(1)
print(f"\\n{frame.f_locals['nonce']} {len(frame.f_locals['tests'])}", flush=True)
os._exit(0)
"""

# An answer that equals whatever it is compared with.
ALWAYS_EQUAL = """
class Anything:
    __eq__ = lambda self, other: True
def add(a, b):
    return Anything()
"""

GOLD_ADD = "def add(a, b):\n    return a + b"
CLONE_NUMBER = {"x86_64": 56, "aarch64": 220}.get(platform.machine(), -1)


def attacks(plan: dict, who: str) -> dict[str, str]:
    """Every attack's source, aimed as `who` ('sandbox' or 'control') aims it."""
    sandboxed = who == "sandbox"
    name = f"escaped-{who}-{plan['nonce']}"
    write_targets = [f"{plan['host_dir']}/{name}", f"{plan['host_dir']}/existing.txt", f"/tmp/{name}", f"/dev/shm/{name}",
                     f"{REPO}/.clotho/{name}", f"{Path.home()}/{name}", f"../{name}", f"/proc/self/cwd/../{name}"]  # fmt: skip
    sleeper = plan["sleepers"][who]
    # The control signals its own sleeper only; the sandbox aims at everything outside it.
    targets = [(sleeper, int(signal.SIGKILL))]
    targets += [(plan["scorer_pid"], int(signal.SIGUSR1)), (plan["test_pid"], int(signal.SIGUSR2))] if sandboxed else []
    unix_sockets = [plan["abstract_socket"]] + ([plan["file_socket"]] if LEVEL == "bwrap" or not sandboxed else [])
    return {
        "environment": _source(ENVIRONMENT, SECRET=plan["secret"], PIDS=[plan["scorer_pid"], plan["test_pid"]]),
        "files": _source(FILES, PATHS=plan["secret_paths"]),
        "descriptors": _source(DESCRIPTORS, SECRET=plan["secret"]),
        "fill": _source(FILL, LIMIT_MB=Limits().file_mb),
        "writes": _source(WRITES, TARGETS=write_targets, HOST_DIR=plan["host_dir"], NAME=name, WHO=who),
        "network": _source(NETWORK, HOSTS=plan["hosts"], TCP_PORT=plan["tcp_port"], UDP_PORT=plan["udp_port"],
                           UNIX_SOCKETS=unix_sockets, INTERNET=[("1.1.1.1", 53)], WHO=who),  # fmt: skip
        "signals": _source(SIGNALS, TARGETS=targets, BROADCAST=sandboxed and SAFE_TO_BROADCAST),
        "user_namespace": _source(USER_NAMESPACE, CLONE=CLONE_NUMBER),
        "privilege": _source(PRIVILEGE),
    }


# ---------------------------------------------------------------------------------------------
# The scoring process: `python -m tests.reliability.test_security < plan.json`, what a rollout flow
# is to code_exec: secrets in its environment, a secret file and a connection open.


def score_attacks() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from environments.code_exec import CodeExec, CodeItem
    from environments.sandbox import run_python

    plan = json.load(sys.stdin)
    plan["scorer_pid"] = os.getpid()
    signalled = []
    signal.signal(signal.SIGUSR1, lambda number, frame: signalled.append(number))
    secret_file = os.open(plan["secret_paths"][0], os.O_RDONLY)
    connection, other_end = socket.socketpair()
    other_end.sendall(plan["secret"].encode())  # waiting unread on `connection`, as a reply would
    os.set_inheritable(secret_file, True)
    connection.set_inheritable(True)
    env = CodeExec({"seed": 0}, client=None, tokenizer=plan["tokenizer"])

    def verdict(source: str, tests: list[str]) -> dict:
        started = time.monotonic()
        result = env.verdict(CodeItem(id="attack", prompt="p", tests=tests, solution=""), f"```python\n{source}\n```")
        return {"score": result.score, "seconds": time.monotonic() - started}

    def attacked(item: tuple[str, str]) -> tuple[str, dict]:
        name, source = item
        outcome = verdict(source, ["assert attack() == 'contained'"])
        if outcome["score"] != 1.0:  # what it got hold of, for the failure message
            shown = run_python(source + "\nprint(attack())", env.config.limits)
            outcome["shown"] = (shown.stdout + shown.stderr)[-2000:]
        return name, outcome

    def control(item: tuple[str, str]) -> tuple[str, str]:
        name, source = item
        fds = (secret_file, connection.fileno()) if name == "descriptors" else ()
        done = subprocess.run([sys.executable, "-I", "-c", source + "\nprint(attack())"], env={"PATH": PATH}, pass_fds=fds,
                              cwd=plan["control_dir"], capture_output=True, text=True, timeout=60)  # fmt: skip
        return name, (done.stdout + done.stderr).strip()[-2000:]

    report = {}
    with ThreadPoolExecutor(4) as pool:
        report["controls"] = dict(pool.map(control, attacks(plan, "control").items()))
    with ThreadPoolExecutor(len(attacks(plan, "sandbox"))) as pool:
        report["sandbox"] = dict(pool.map(attacked, attacks(plan, "sandbox").items()))
        report["sandbox"]["linger"] = attacked(("linger", _source(LINGER, MARKER=plan["markers"]["linger"])))[1]
        # A fork bomb, and beside it another sandbox run that must not lose its process budget to it.
        bomb = pool.submit(verdict, _source(BOMB, MARKER=plan["markers"]["bomb"]), ["assert True"])
        time.sleep(0.5)
        sibling = pool.submit(verdict, GOLD_ADD, ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"])
        report["bomb"], report["sibling"] = bomb.result(), sibling.result()
    report["forged"] = verdict(FORGED_COUNT, ["assert add(1, 2) == 3", "assert False"])
    report["always_equal"] = verdict(ALWAYS_EQUAL, ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"])
    report["signalled"] = signalled
    print(json.dumps(report))


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
        for channel, listener in (("tcp", self.tcp), ("udp", self.udp), ("abstract unix", self.abstract), ("file unix", self.file)):
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


def host_address() -> str | None:
    """This machine's first IPv4 address that is not loopback."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


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
        "nonce": nonce, "secret": secret, "tokenizer": str(tiny_model_dir), "host_dir": str(host_dir),
        "control_dir": str(control_dir), "test_pid": os.getpid(),
        "secret_paths": [str(secret_file), str(REPO / "pyproject.toml"), str(REPO / ".git" / "config"),
                         str(Path.home() / ".aws" / "credentials"), "/etc/passwd", "/etc/shadow"],
        "sleepers": {who: process.pid for who, process in sleepers.items()},
        "hosts": ["127.0.0.1"] + ([host_address()] if host_address() else []), "tcp_port": listeners.tcp.getsockname()[1],
        "udp_port": listeners.udp.getsockname()[1], "abstract_socket": listeners.abstract_name,
        "file_socket": listeners.file_name, "markers": markers,
    }  # fmt: skip
    environment = {**os.environ, "CLOTHO_API_KEY": secret, "AWS_SECRET_ACCESS_KEY": secret}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "tests.reliability.test_security"], input=json.dumps(plan), cwd=REPO,
                              env=environment, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, f"the scoring process failed ({done.returncode}):\n{done.stderr[-4000:]}"
        report = json.loads(done.stdout.strip().splitlines()[-1])
        time.sleep(0.5)  # let the listeners take in anything still in flight
        report |= {
            "seconds": time.monotonic() - started, "arrived": list(listeners.arrived), "test_signalled": list(received),
            "sleepers_alive": {who: process.poll() is None for who, process in sleepers.items()},
            "markers_most": {name: watch.most[marker] for name, marker in markers.items()},
            "markers_now": {name: watch.count()[marker] for name, marker in markers.items()},
            "written": {who: sorted(str(p) for p in written_by(plan, who)) for who in ("sandbox", "control")},
            "existing": (host_dir / "existing.txt").read_text(),
        }  # fmt: skip
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
    places = [Path(plan["host_dir"]), Path(plan["control_dir"]), Path("/tmp"), Path("/dev/shm"), REPO / ".clotho", Path.home(), Path("/")]
    return [place / name for place in places if (place / name).exists()]


def assert_contained(escapes: dict, name: str) -> None:
    outcome = escapes["sandbox"][name]
    assert outcome["score"] == 1.0, f"attack {name!r} was not contained under {LEVEL}: {outcome.get('shown')}"
    assert outcome["seconds"] < Limits().wall_seconds + 5, outcome


def assert_control_escaped(escapes: dict, name: str, *expected: str) -> None:
    """Outside the sandbox the same code gets hold of what it aims at: the attack works."""
    shown = escapes["controls"][name]
    assert shown.startswith("escaped"), f"attack {name!r} gets nothing even without the sandbox (a broken attack): {shown}"
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
    assert {channel for channel, who in arrived if who == "control"} >= {"tcp", "udp", "abstract unix", "file unix"}, arrived
    assert_contained(escapes, "network")
    assert [(channel, who) for channel, who in arrived if who != "control"] == []


@pytest.mark.skipif(not SAFE_TO_BROADCAST, reason=f"{LEVEL} runs the program as root here: kill(-1) would reach the host")
def test_signals_never_reach_a_process_outside(escapes) -> None:
    """SIGKILL to a sleeper the test started, SIGUSR1 to the scoring process, SIGUSR2 to the test,
    SIGKILL to every process it may signal (kill -1)."""
    assert_control_escaped(escapes, "signals", "signal 9")
    assert not escapes["sleepers_alive"]["control"], "the control's SIGKILL did not reach its sleeper"
    assert_contained(escapes, "signals")
    assert escapes["sleepers_alive"]["sandbox"] and escapes["signalled"] == [] and escapes["test_signalled"] == []


@needs_bwrap
@pytest.mark.skipif(CLONE_NUMBER < 0, reason=f"no seccomp filter for {platform.machine()} (environments.sandbox._SYSCALLS)")
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


@pytest.mark.skipif(not drops_uid(LEVEL), reason=f"{LEVEL} runs the program as this (root) user, whom RLIMIT_NPROC exempts")
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
        steps = [(int.from_bytes(program[i : i + 2], sys.byteorder), program[i + 2], program[i + 3]) for i in range(0, len(program), 8)]
        for index, (code, yes, no) in enumerate(steps):
            if code & 0x07 == 0x05:  # a jump
                assert index + 1 + max(yes, no) < len(steps)
        assert steps[-1][0] == 0x06  # a return
    assert seccomp_filter("riscv64") is None


# ---------------------------------------------------------------------------------------------
# The policy server's dev routes


def test_the_key_is_compared_only_in_constant_time() -> None:
    """No ==, !=, in or is touches the key or the token in clotho_auth; hmac.compare_digest does."""
    path = REPO / "inference" / "vllm_plugins" / "clotho_auth.py"
    tree = ast.parse(path.read_text())
    secrets_named = {"key", "token"}

    def names(node: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    compares = [node for node in ast.walk(tree) if isinstance(node, ast.Compare)]
    for node in compares:
        assert not names(node) & secrets_named, f"line {node.lineno} of {path.name} compares the key with {ast.unparse(node)!r}"
    digests = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "hmac.compare_digest"]
    assert digests and all(names(call) >= secrets_named for call in digests)


async def test_the_middleware_decides_by_compare_digest(monkeypatch) -> None:
    """Run in this process: every request's token goes through hmac.compare_digest, whose answer
    alone lets it in."""
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse

    spec = importlib.util.spec_from_file_location("clotho_auth", REPO / "inference" / "vllm_plugins" / "clotho_auth.py")
    auth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(auth)
    calls = []

    class Spy:
        @staticmethod
        def compare_digest(a, b):
            calls.append((a, b))
            return __import__("hmac").compare_digest(a, b)

    monkeypatch.setattr(auth, "hmac", Spy)
    monkeypatch.setenv("VLLM_API_KEY", "sk-dummy-SECRET-123")

    async def answered(path: str, authorization: str | None) -> int:
        headers = [(b"authorization", authorization.encode())] if authorization else []
        request = Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""})
        response = await auth.require_api_key(request, lambda request: asyncio.sleep(0, PlainTextResponse("in")))
        return response.status_code

    assert await answered("/collective_rpc", "Bearer sk-dummy-SECRET-123") == 200
    assert calls[-1] == (b"sk-dummy-SECRET-123", b"sk-dummy-SECRET-123")
    for wrong in ("sk-dummy-SECRET-124", "sk-dummy-SECRET-12", "sk-dummy-SECRET-1234", "x" * 19, ""):
        before = len(calls)
        assert await answered("/collective_rpc", f"Bearer {wrong}") == 401
        assert calls[before:] == [(wrong.encode(), b"sk-dummy-SECRET-123")]
    assert await answered("/pause", None) == 401 and await answered("/pause", "sk-dummy-SECRET-123") == 401
    assert await answered("/health", None) == 200
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert await answered("/pause", "Bearer ") == 401  # no key configured lets nobody in


class Remote:
    """Another machine on this one's network: a network namespace joined by a veth pair (as root,
    where namespaces work), else this machine's own non-loopback address as the client's."""

    def __init__(self):
        self.namespace = None
        if AS_ROOT and shutil.which("ip"):
            self.namespace = f"clotho-sec-{secrets.token_hex(3)}"
            subnet = f"10.{random.randrange(64, 250)}.{random.randrange(0, 250)}"
            host_end, remote_end = f"cs{secrets.token_hex(3)}h", f"cs{secrets.token_hex(3)}r"
            for command in (
                f"ip netns add {self.namespace}",
                f"ip link add {host_end} type veth peer name {remote_end}",
                f"ip link set {remote_end} netns {self.namespace}",
                f"ip addr add {subnet}.1/30 dev {host_end}",
                f"ip link set {host_end} up",
                f"ip netns exec {self.namespace} ip addr add {subnet}.2/30 dev {remote_end}",
                f"ip netns exec {self.namespace} ip link set {remote_end} up",
            ):
                if subprocess.run(command.split(), capture_output=True).returncode != 0:  # e.g. a container without netns
                    subprocess.run(["ip", "link", "del", host_end], capture_output=True)
                    self.close()
                    self.namespace = None
                    break
            else:
                self.address, self.client_address = f"{subnet}.1", f"{subnet}.2"
        if self.namespace is None:
            self.address = self.client_address = host_address()
            if self.address is None:
                pytest.skip("no network namespace and no non-loopback address on this machine")

    def send(self, port: int, requests: list[dict]) -> list[dict]:
        """Each request {method, path, headers?, raw?} to this machine's address from the remote:
        [{status, body} or {error}]."""
        command = [sys.executable, "-I", "-c", CLIENT, self.address, str(port), self.client_address]
        if self.namespace:
            command = ["ip", "netns", "exec", self.namespace, *command]
        done = subprocess.run(command, input=json.dumps(requests), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    def close(self) -> None:
        if self.namespace:
            subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)  # takes the veth pair along


# Runs on the remote: plain http.client (paths sent exactly as written), or raw bytes for an upgrade.
CLIENT = r"""
import http.client, json, socket, sys
host, port, source = sys.argv[1], int(sys.argv[2]), sys.argv[3]
answers = []
for request in json.load(sys.stdin):
    try:
        if "raw" in request:
            with socket.create_connection((host, port), timeout=10, source_address=(source, 0)) as sock:
                sock.sendall(request["raw"].encode())
                answers.append({"status": int(sock.recv(4096).split(b" ")[1]), "body": ""})
            continue
        connection = http.client.HTTPConnection(host, port, timeout=30, source_address=(source, 0))
        body = request.get("body", "{}").encode() if request["method"] in ("POST", "PUT", "PATCH") else None
        headers = {"Content-Type": "application/json", **request.get("headers", {})}
        connection.request(request["method"], request["path"], body=body, headers=headers)
        response = connection.getresponse()
        answers.append({"status": response.status, "body": response.read(300).decode(errors="replace")})
        connection.close()
    except OSError as error:
        answers.append({"error": f"{type(error).__name__}: {error}"})
print(json.dumps(answers))
"""

KEY = "sk-dummy-SECRET-123"
WRONG_CREDENTIALS = [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": f"Bearer {KEY}4"},
    {"Authorization": f"Bearer {KEY.upper()}"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY},
    {"Authorization": "Bearer "}, {"X-API-Key": KEY}, {"Cookie": f"api_key={KEY}"},
]  # fmt: skip
# Not in the OpenAPI document, or the same routes spelled otherwise.
EXTRA_PATHS = ["/docs", "/redoc", "/openapi.json", "/nonexistent", "//pause", "/pause/", "/./pause", "/health/../pause",
               "/%70ause", "/health/%2e%2e/collective_rpc", "/PAUSE", f"/pause?api_key={KEY}"]  # fmt: skip
OPEN_PATHS = {"/health"}


@pytest.fixture(scope="module")
def remote():
    client = Remote()
    yield client
    client.close()


@pytest.fixture(scope="module")
def public_server(tiny_model_dir):
    """A server bound to every address, with an API key: what clotho serve --host 0.0.0.0 --api-key starts."""
    from inference.server import PolicyServer
    from tests.conftest import CACHE

    # Eager: it only answers a few requests, and skipping torch.compile saves ~30 s of its start.
    server = PolicyServer(tiny_model_dir, host="0.0.0.0", api_key=KEY, log_path=CACHE / "logs" / "vllm-public.log", extra_args=["--enforce-eager"])
    server.start(timeout=600)
    yield server
    server.stop()


def every_route(server) -> list[tuple[str, str]]:
    import httpx

    document = httpx.get(f"http://127.0.0.1:{server.port}/openapi.json", headers=server.headers, timeout=30).json()
    routes = [(method.upper(), path.replace("{", "").replace("}", "")) for path, methods in document["paths"].items() for method in methods]
    routes += [("HEAD", path) for method, path in routes if method == "GET"]
    return routes + [("POST", path) for path in EXTRA_PATHS] + [("GET", path) for path in EXTRA_PATHS]


@pytest.mark.integration
def test_dev_routes_refuse_every_request_without_the_right_key_from_off_this_machine(public_server, remote) -> None:
    routes = every_route(public_server)
    dev = {"/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/weight_info", "/sleep"}
    assert dev <= {path for _, path in routes}, "vLLM's dev mode is off: the routes under test are missing"
    requests = [{"method": method, "path": path, "headers": headers} for method, path in routes for headers in WRONG_CREDENTIALS]
    # A body the route would act on: an announcement that must not happen.
    requests += [{"method": "POST", "path": "/update_weight_version", "headers": headers, "body": '{"new_version": "999"}'}
                 for headers in WRONG_CREDENTIALS]  # fmt: skip
    # An upgrade to a WebSocket: clotho's middleware sees HTTP only, vLLM's own check covers /v1.
    upgrade = "GET {} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    requests += [{"raw": upgrade.format(path)} for path in ("/v1/realtime", "/collective_rpc", "/pause")]
    answers = remote.send(public_server.port, requests)
    # An HTTP request is refused with 401; an upgrade with anything but 101 Switching Protocols.
    let_in = [(r.get("method"), r.get("path") or r["raw"].split()[1], r.get("headers"), a) for r, a in zip(requests, answers, strict=True)
              if (a.get("status") == 101 if "raw" in r else r["path"].split("?")[0] not in OPEN_PATHS and a.get("status") != 401)]  # fmt: skip
    assert let_in == [], f"{len(let_in)} of {len(requests)} requests from {remote.client_address} were not refused: {let_in[:10]}"

    # The right key opens them, from the same remote: the refusals above were for want of the key.
    authorized = {"Authorization": f"Bearer {KEY}"}
    checks = [("GET", "/health", {}), ("GET", "/is_paused", authorized), ("GET", "/weight_info", authorized),
              ("GET", "/is_sleeping", authorized), ("GET", "/v1/models", authorized), ("POST", "/pause", authorized),
              ("GET", "/is_paused", authorized), ("POST", "/resume", authorized), ("GET", "/is_paused", authorized)]  # fmt: skip
    answers = remote.send(public_server.port, [{"method": m, "path": p, "headers": h} for m, p, h in checks])
    assert [a.get("status") for a in answers] == [200] * len(checks), answers
    # Nothing refused had an effect: never paused or put to sleep before the keyed /pause, version unchanged.
    paused = [json.loads(a["body"])["is_paused"] for a in (answers[1], answers[6], answers[8])]
    assert paused == [False, True, False] and json.loads(answers[3]["body"])["is_sleeping"] is False
    from inference.client import parse_weight_version

    assert parse_weight_version(json.loads(answers[2]["body"]).get("weight_version")) == 0, answers[2]  # never announced


@pytest.mark.integration
def test_options_requests_pass_the_key_check_but_run_nothing(public_server, remote) -> None:
    """The middleware lets OPTIONS through unauthenticated (CORS preflights carry no credentials):
    none of them may reach a handler."""
    posts = ["/pause", "/sleep", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/scale_elastic_ep"]
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    requests = [{"method": "OPTIONS", "path": path, "headers": headers} for path in posts for headers in ({}, preflight)]
    answers = remote.send(public_server.port, requests)
    assert all(a.get("status") in (200, 400, 405) for a in answers), answers
    authorized = {"Authorization": f"Bearer {KEY}"}
    state = remote.send(public_server.port, [{"method": "GET", "path": p, "headers": authorized} for p in ("/is_paused", "/is_sleeping")])
    assert [json.loads(a["body"]) for a in state] == [{"is_paused": False}, {"is_sleeping": False}], state


@pytest.mark.integration
def test_a_server_without_a_key_cannot_be_reached_off_loopback(policy_server, remote) -> None:
    """Without a key PolicyServer binds loopback only (a public bind without a key is refused:
    tests/inference/test_server.py): from another address nothing answers on its port."""
    port = int(policy_server.base_url.rsplit(":", 1)[1].split("/")[0])
    answers = remote.send(port, [{"method": "POST", "path": "/collective_rpc"}, {"method": "GET", "path": "/health"}])
    assert all("error" in answer for answer in answers), f"{policy_server.base_url} answered off loopback: {answers}"
    assert "Connection" in answers[0]["error"] or "refused" in answers[0]["error"].lower(), answers


if __name__ == "__main__":
    score_attacks()

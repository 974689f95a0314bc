"""The sandbox escapes of tests/reliability/test_security.py: the attacks (source a model could
emit) and the scoring process that runs them, `python -m tests.reliability.sandbox_attacks < plan.json`."""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from environments.sandbox import PATH, Limits, drops_uid, isolation

REPO = Path(__file__).resolve().parents[2]
LEVEL = isolation()
AS_ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(
    LEVEL != "bwrap", reason=f"needs bubblewrap's own filesystem (this machine gets {LEVEL})"
)
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
FORKS = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass"
os.execv(sys.executable, [sys.executable, "-c", FORKS, MARKER])
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
    write_targets = [
        f"{plan['host_dir']}/{name}",
        f"{plan['host_dir']}/existing.txt",
        f"/tmp/{name}",
        f"/dev/shm/{name}",
        f"{REPO}/.clotho/{name}",
        f"{Path.home()}/{name}",
        f"../{name}",
        f"/proc/self/cwd/../{name}",
    ]
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
        "network": _source(
            NETWORK,
            HOSTS=plan["hosts"],
            TCP_PORT=plan["tcp_port"],
            UDP_PORT=plan["udp_port"],
            UNIX_SOCKETS=unix_sockets,
            INTERNET=[("1.1.1.1", 53)],
            WHO=who,
        ),
        "signals": _source(SIGNALS, TARGETS=targets, BROADCAST=sandboxed and SAFE_TO_BROADCAST),
        "user_namespace": _source(USER_NAMESPACE, CLONE=CLONE_NUMBER),
        "privilege": _source(PRIVILEGE),
    }


def host_address() -> str | None:
    """This machine's first IPv4 address that is not loopback."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


# ---------------------------------------------------------------------------------------------
# The scoring process: `python -m tests.reliability.test_security < plan.json`, what a rollout flow
# is to code_exec: secrets in its environment, a secret file and a connection open.


def score_attacks() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from environments.bundled.code_exec import CodeExec, CodeItem
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
        done = subprocess.run(
            [sys.executable, "-I", "-c", source + "\nprint(attack())"],
            env={"PATH": PATH},
            pass_fds=fds,
            cwd=plan["control_dir"],
            capture_output=True,
            text=True,
            timeout=60,
        )
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


if __name__ == "__main__":
    score_attacks()

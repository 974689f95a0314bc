"""The sandbox stops what untrusted code does to the machine: endless loops, memory and fork bombs,
network connections, writes outside its directory, reading the parent's environment."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from environments.sandbox import LEVELS, PATH, Limits, available, drops_uid, isolation, run_python

LEVEL = isolation()
needs_bwrap = pytest.mark.skipif(LEVEL != "bwrap", reason=f"needs bubblewrap (this machine gets {LEVEL})")


def test_the_strongest_isolation_is_active_when_its_tool_is_installed() -> None:
    assert LEVEL in LEVELS and available("rlimits")
    if shutil.which("bwrap"):  # installed but failing its probe would silently weaken every run
        assert LEVEL == "bwrap", (
            "bwrap is installed but cannot run a program; see run_python(..., level='bwrap').stderr"
        )
    result = run_python("import os, sys\nprint(os.listdir('.'), sys.stdin.read() == '')")
    assert result.exit_code == 0 and result.stdout == "['main.py'] True\n" and result.isolation == LEVEL


def test_an_endless_loop_is_killed_by_cpu_time_or_wall_clock() -> None:
    spinning = run_python("while True:\n    pass", Limits(cpu_seconds=1, wall_seconds=8))
    assert spinning.killed in ("cpu_time", "wall_time") and spinning.exit_code != 0 and spinning.seconds < 8.5
    sleeping = run_python("import time\nwhile True:\n    time.sleep(1)", Limits(wall_seconds=1))
    assert sleeping.timed_out and sleeping.killed == "wall_time" and sleeping.seconds < 2


def test_a_program_starved_of_cpu_by_a_loaded_host_is_told_from_a_slow_one() -> None:
    """Killed at the wall-clock limit, a program that wanted a CPU and got about a tenth of one is
    `infra` (the machine's failure); one that slept there is not; both report their CPU time."""
    from clotho.testing.cpu_hog import cpu_hog

    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass\nprint('done')"
    alone = run_python(busy, Limits(wall_seconds=2))
    assert alone.stdout == "done\n" and not alone.infra and 0.3 < alone.cpu_seconds < 1.5
    with cpu_hog():
        starved = run_python(busy, Limits(wall_seconds=2))
    assert starved.killed == "wall_time" and starved.infra, starved
    assert starved.cpu_seconds < 0.5 and starved.waited_seconds > 1.0, starved
    sleeping = run_python("import time\ntime.sleep(10)", Limits(wall_seconds=1))
    assert sleeping.killed == "wall_time" and not sleeping.infra and sleeping.waited_seconds < 0.25, sleeping


def test_a_memory_bomb_stops_at_the_address_space_limit() -> None:
    limits = Limits(memory_mb=128)
    assert run_python("block = bytearray(48 << 20)\nprint('fits')", limits).stdout == "fits\n"
    bomb = run_python("hoard = []\nwhile True:\n    hoard.append(bytearray(10 << 20))", limits)
    assert bomb.killed == "memory" and bomb.exit_code != 0 and "MemoryError" in bomb.stderr


@pytest.mark.skipif(
    not drops_uid(LEVEL), reason=f"{LEVEL} runs the program as this (root) user, whom RLIMIT_NPROC exempts"
)
def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing_behind() -> None:
    limits = Limits(processes=12, wall_seconds=5)
    counting = (
        "import os, time\nforks = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
        "            os._exit(0)\n        forks += 1\nexcept BlockingIOError:\n    print(os.getuid(), forks)"
    )
    result = run_python(counting, limits)
    uid, forks = map(int, result.stdout.split())
    assert forks == limits.processes - 1, result.stderr  # the program itself is the 12th process
    bomb = run_python("import os\nprint(os.getuid(), flush=True)\nwhile True:\n    os.fork()", limits)
    assert bomb.exit_code != 0 and bomb.seconds < limits.wall_seconds + 1
    for bomb_uid in (uid, int(bomb.stdout.split()[0])):  # the sleepers and the bomb's processes are gone
        owners = [
            line.split()[1]
            for status in Path("/proc").glob("[0-9]*/status")
            for line in _lines(status)
            if line.startswith("Uid:")
        ]
        assert str(bomb_uid) not in owners


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:  # the process ended while we looked
        return []


@pytest.mark.skipif(LEVEL == "rlimits", reason="rlimits alone keeps the host's network")
def test_a_socket_connect_to_the_host_never_arrives() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        program = (
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
            "except OSError as error:\n    print(type(error).__name__)"
        )
        result = run_python(program)
        assert result.stdout in ("ConnectionRefusedError\n", "OSError\n"), result.stderr
        with pytest.raises(TimeoutError):
            listener.accept()


@needs_bwrap
def test_writes_outside_its_directory_do_not_reach_the_host() -> None:
    host = Path(tempfile.mkdtemp(prefix="clotho-sandbox-test-"))
    host.chmod(0o777)  # writable by anyone: only the sandbox's own filesystem keeps the program out
    try:
        targets = [
            host / "escaped.txt",
            Path("/tmp") / f"{host.name}-escaped.txt",
            Path(PATH.split(":")[0]) / "escaped",
        ]
        program = (
            f"open('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())\nfor path in {[str(t) for t in targets]!r}:\n"
            "    try:\n        open(path, 'w').write('escaped')\n        print('wrote', path)\n"
            "    except OSError as error:\n        print(type(error).__name__)"
        )
        result = run_python(program)
        assert result.stdout.splitlines()[0] == "ok" and "wrote" not in result.stdout, result.stdout
        assert not any(target.exists() for target in targets)
    finally:
        shutil.rmtree(host)


def test_the_parents_environment_variables_are_not_inherited(monkeypatch) -> None:
    monkeypatch.setenv("CLOTHO_TEST_SECRET", "sandbox-must-not-see-this")
    result = run_python("import json, os\nprint(json.dumps(dict(os.environ)))")
    environment = json.loads(result.stdout)
    assert "sandbox-must-not-see-this" not in result.stdout and environment["PATH"] == PATH
    assert set(environment) <= {"PATH", "PWD", "LC_CTYPE"}  # PWD from bwrap, LC_CTYPE from Python's locale coercion


def test_output_is_bounded_to_its_tail() -> None:
    result = run_python("print('x' * 100_000)\nprint('end')", Limits(output_bytes=1024))
    assert len(result.stdout) == 1024 and result.stdout.endswith("x\nend\n")

"""A loaded host for tests: busy processes that leave a program about a tenth of a core.

Nine a core, each in a session of its own: where the kernel groups sessions (autogroups, the
default) it shares the cores between sessions first, so the program's session gets one share of
19 on two cores, as it would with autogroups off (19 tasks at the same niceness). No root needed."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

PER_CORE = 9


@contextlib.contextmanager
def cpu_hog() -> Iterator[None]:
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(PER_CORE * (os.cpu_count() or 1))
    ]
    time.sleep(1.0)  # until they spin: a Python takes a moment to start
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()

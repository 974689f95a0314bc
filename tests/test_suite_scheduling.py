"""`make test`'s two workers take whole modules (and tests/inference whole): a module's fixtures
start one vLLM server, not one per worker. Checked by running pytest as `make test` does, since the
grouping once stopped working silently when pytest changed how it stores node ids."""

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import fixture_scope

REPO = Path(__file__).resolve().parents[1]
MODULES = [
    "tests/inference/test_reload_units.py",
    "tests/inference/test_tiny_model.py",
    "tests/trainer/test_losses.py",
    "tests/storage/test_layout.py",
]


def test_fixture_scope_is_the_module_or_the_inference_package():
    assert fixture_scope("tests/flows/test_pipeline.py::test_x[a-b]") == "tests/flows/test_pipeline.py"
    assert fixture_scope("tests/inference/test_reload.py::test_x") == "tests/inference"


@pytest.mark.integration
def test_two_workers_each_take_whole_scopes():
    missing = [module for module in MODULES if not (REPO / module).exists()]
    assert not missing, f"{missing} moved: name other fast modules here"
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadscope", "-v", "-p", "no:cacheprovider", *MODULES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    workers = defaultdict(set)
    for worker, nodeid in re.findall(r"^\[(gw\d+)\] .*?PASSED (\S+)", ran.stdout, flags=re.MULTILINE):
        workers[fixture_scope(nodeid)].add(worker)
    assert set(workers) == {"tests/inference", *MODULES[2:]}, ran.stdout[-3000:]
    split = {scope: sorted(names) for scope, names in workers.items() if len(names) > 1}
    assert not split, f"scopes run on several workers: {split}"
    assert len(set().union(*workers.values())) == 2, "one worker took everything: the check shows nothing"

"""An environment in a package of its own, as an outside author makes it: `clotho env new`, pip
install, then `clotho env list`, `clotho env check` and the package's own pytest, all against the
live tiny vLLM server. The author touches one module and its test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CLOTHO = str(Path(sys.executable).with_name("clotho"))


def run(command: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return done


def test_an_outside_package_installs_lists_and_passes_the_conformance_suite(policy_server, tiny_model_dir, tmp_path):
    package, site = tmp_path / "word-echo", tmp_path / "site"
    made = run([CLOTHO, "env", "new", "word_echo", "--dir", str(package)], dict(os.environ), tmp_path)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in package.iterdir()) == ["pyproject.toml", "test_word_echo.py", "word_echo.py"]
    # The author's edit: a config knob of their own, used by the reward.
    module = package / "word_echo.py"
    module.write_text(module.read_text().replace("default=1, ge=1, le=4", "default=2, ge=1, le=4"))

    # A real pip install (wheel built by setuptools), into a directory of its own so the suite's
    # environment is left as it was; PYTHONPATH makes it importable and its entry point visible.
    installed = run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",  # as `clotho env new` says: setuptools from the environment, offline
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(package),
        ],
        dict(os.environ),
        tmp_path,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "200"}

    listed = run([CLOTHO, "env", "list"], env, tmp_path)
    assert listed.returncode == 0 and "word_echo" in listed.stdout and "clotho-env-word-echo" in listed.stdout, (
        listed.stdout
    )

    # No --server: `clotho env check` starts a tiny-model vLLM server of its own for the check.
    checked = run([CLOTHO, "env", "check", "word_echo"], env, tmp_path, timeout=900)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "starting a tiny-model vLLM server" in checked.stdout, checked.stdout
    assert "8 of 8 checks passed" in checked.stdout and "failed" not in checked.stdout, checked.stdout

    # The package's own test file runs the same suite through clotho's pytest plugin.
    tested = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_word_echo.py"],
        {**env, "CLOTHO_SERVER_URL": policy_server.base_url, "CLOTHO_TOKENIZER": str(tiny_model_dir)},
        package,
    )
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-2000:]
    assert "8 passed" in tested.stdout, tested.stdout[-2000:]


def test_env_check_reports_a_failing_environment_and_exits_1(policy_server, tiny_model_dir, tmp_path):
    repo = Path(__file__).resolve().parents[2]
    checked = run(
        [
            CLOTHO,
            "env",
            "check",
            "tests.environments.test_conformance:WrongGold",
            "--server",
            policy_server.base_url,
            "--tokenizer",
            str(tiny_model_dir),
        ],
        {**os.environ, "PYTHONPATH": str(repo)},
        repo,
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "failed" in checked.stdout and "gold answer scores top" in checked.stdout


def test_env_check_names_a_bad_config_field_before_sampling(tmp_path):
    checked = run(
        [CLOTHO, "env", "check", "arithmetic", "--server", "http://127.0.0.1:9", "--set", "max_operand=0"],
        dict(os.environ),
        tmp_path,
    )
    assert checked.returncode == 2 and "max_operand" in checked.stderr, checked.stderr

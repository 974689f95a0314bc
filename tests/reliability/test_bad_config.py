"""Bad configuration and CLI input, through the commands users type: an unknown environment, a
malformed URL, a missing model directory, a tokenizer that differs from the shards', a negative or
absurd knob. Each gives exit code 2 and one line on stderr naming the field and the fix, no
traceback, and writes nothing (the working directory, the run and Prefect's home stay as they were).

One case per command runs the real console script in a subprocess; the rest run in-process through
typer's CliRunner (the same `main`, without two seconds of start-up each)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clotho.cli import app
from clotho.testing.groups import make_groups
from environments.testing import cached_tiny_model
from storage.writer import ShardWriter

CLOTHO = str(Path(sys.executable).with_name("clotho"))


def files_under(root: Path) -> dict[str, int]:
    """Every file and directory under `root`, with file sizes: what 'nothing written' compares."""
    return {str(path.relative_to(root)): path.stat().st_size if path.is_file() else -1 for path in root.rglob("*")}


def the_error_line(exit_code: int, stdout: str, stderr: str) -> str:
    """The one error line, after the checks every bad input must pass."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert exit_code == 2, (exit_code, stdout[-2000:], stderr[-2000:])
    assert "Traceback" not in stdout + stderr and "╭" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory holding the inputs: a model, a pipeline config, a run with shards."""
    model = cached_tiny_model()
    (tmp_path / "run.yaml").write_text(
        f"run: {tmp_path}/store/run\nmodel: {model}\nphases:\n  - name: rl\n    steps: 2\n    environments:\n"
        "      - env: arithmetic\n        config: {group_size: 2}\n"
    )
    (tmp_path / "broken.yaml").write_text("run: [a\n")
    with ShardWriter(str(tmp_path / "store"), "sampled", tokenizer=str(model), max_groups=2) as writer:
        writer.add_many(make_groups(2, seed=3))
    (tmp_path / "prefect-home").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLOTHO_API_KEY", raising=False)
    return tmp_path


# (arguments, phrases the error line must hold: the field, and the fix or the rule broken).
# {tmp}: the working directory; {model}: the tiny model.
CASES = {
    "run unknown env": (
        ["run", "run.yaml", "--set", "phases.0.environments.0.env=nope"],
        ["phases.0.environments.0", "'nope'", "give an import path"],
    ),
    "run malformed url": (
        ["run", "run.yaml", "--set", "run=ht!tp://x/run"],
        ["run:", "unknown storage protocol", "use a local path"],
    ),
    "run missing model": (
        ["run", "run.yaml", "--set", "model={tmp}/no-model"],
        ["model:", "does not exist", "clotho model tiny"],
    ),
    "run negative lag": (["run", "run.yaml", "--set", "max_lag=-1"], ["max_lag", "greater than or equal to 0"]),
    "run absurd lr": (
        ["run", "run.yaml", "--set", "trainer.lr=1000"],
        ["lr", "less than or equal to 1", "phases.0.trainer"],
    ),
    "run unknown field": (
        ["run", "run.yaml", "--set", "trainr.lr=1"],
        ["trainr", "unknown field", "fields: run, model"],
    ),
    "run broken yaml": (["run", "broken.yaml"], ["broken.yaml", "not valid YAML", "line 1"]),
    "run env config": (
        ["run", "run.yaml", "--set", "phases.0.environments.0.config.group_size=0"],
        ["group_size", "greater than or equal to 1"],
    ),
    "rollout unknown env": (
        ["rollout", "--env", "nope", "--run", "{tmp}/store/r"],
        ["--env", "'nope'", "give an import path"],
    ),
    "rollout malformed run": (
        ["rollout", "--env", "arithmetic", "--run", "ht!tp://x/r"],
        ["--run", "unknown storage protocol"],
    ),
    "rollout run without name": (
        ["rollout", "--env", "arithmetic", "--run", "s3://"],
        ["--run", "is not STORAGE_URL/RUN"],
    ),
    "rollout malformed server": (
        ["rollout", "--env", "arithmetic", "--run", "{tmp}/store/r", "--server", "localhost:8000"],
        ["--server", "http://127.0.0.1:8000"],
    ),
    "rollout missing tokenizer": (
        ["rollout", "--env", "arithmetic", "--run", "{tmp}/store/r", "--tokenizer", "{tmp}/no-tokenizer"],
        ["--tokenizer", "does not exist", "policy model's directory"],
    ),
    "rollout tokenizer not a tokenizer": (
        ["rollout", "--env", "arithmetic", "--run", "{tmp}/store/r", "--tokenizer", "{tmp}/store"],
        ["--tokenizer", "holds no tokenizer files"],
    ),
    "rollout negative group size": (
        ["rollout", "--env", "arithmetic", "--run", "{tmp}/store/r", "--set", "group_size=-1"],
        ["--set", "group_size", "greater than or equal to 1"],
    ),
    "rollout absurd group size": (
        ["rollout", "--env", "arithmetic", "--run", "{tmp}/store/r", "--set", "group_size=1000000"],
        ["group_size", "less than or equal to 4096"],
    ),
    "rollout unknown env field": (
        ["rollout", "--env", "arithmetic", "--run", "{tmp}/store/r", "--set", "groupsize=2"],
        ["groupsize", "fields of ArithmeticConfig"],
    ),
    "rollout zero groups": (
        ["rollout", "--env", "arithmetic", "--run", "{tmp}/store/r", "--groups", "0"],
        ["--groups", "greater than or equal to 1"],
    ),
    "rollout absurd lanes": (
        ["rollout", "--env", "arithmetic", "--run", "{tmp}/store/r", "--max-concurrent-groups", "100000"],
        ["--max-concurrent-groups", "less than or equal to 4096"],
    ),
    "train missing model": (
        ["train", "--run", "{tmp}/store/sampled", "--model", "{tmp}/no-model", "--steps", "1"],
        ["--model", "does not exist", "clotho model tiny"],
    ),
    "train model not a model": (
        ["train", "--run", "{tmp}/store/sampled", "--model", "{tmp}/store", "--steps", "1"],
        ["--model", "no config.json"],
    ),
    "train malformed run": (
        ["train", "--run", "ht!tp://x/r", "--model", "{model}", "--steps", "1"],
        ["--run", "unknown storage protocol"],
    ),
    "train negative steps": (
        ["train", "--run", "{tmp}/store/sampled", "--model", "{model}", "--steps", "-1"],
        ["--steps", "greater than or equal to 1"],
    ),
    "train negative lr": (
        ["train", "--run", "{tmp}/store/sampled", "--model", "{model}", "--steps", "1", "--set", "lr=-1"],
        ["--set", "lr", "greater than 0"],
    ),
    "train absurd lr": (
        ["train", "--run", "{tmp}/store/sampled", "--model", "{model}", "--steps", "1", "--set", "lr=1000"],
        ["lr", "less than or equal to 1"],
    ),
    "train unknown field": (
        ["train", "--run", "{tmp}/store/sampled", "--model", "{model}", "--steps", "1", "--set", "learning_rate=1"],
        ["learning_rate", "unknown field", "lr"],
    ),
    "serve missing model": (["serve", "--model", "{tmp}/no-model"], ["--model", "does not exist"]),
    "serve bad port": (["serve", "--model", "{model}", "--port", "70000"], ["--port", "less than or equal to 65535"]),
    "serve open host without key": (
        ["serve", "--model", "{model}", "--host", "0.0.0.0"],
        ["host 0.0.0.0", "--api-key"],
    ),
    "serve bad dtype": (["serve", "--model", "{model}", "--dtype", "float99"], ["--dtype", "bfloat16"]),
    "serve malformed run": (
        ["serve", "--model", "{model}", "--run", "ht!tp://x/r"],
        ["--run", "unknown storage protocol"],
    ),
    "env check unknown env": (["env", "check", "nope", "--server", "http://127.0.0.1:9"], ["ENVIRONMENT", "'nope'"]),
    "env check malformed server": (
        ["env", "check", "arithmetic", "--server", "127.0.0.1:9"],
        ["--server", "http(s) URL"],
    ),
    "env check negative knob": (
        ["env", "check", "arithmetic", "--server", "http://127.0.0.1:9", "--set", "temperature=-1"],
        ["--set", "temperature"],
    ),
    "env check missing tokenizer": (
        ["env", "check", "arithmetic", "--server", "http://127.0.0.1:9", "--tokenizer", "{tmp}/nothing"],
        ["--tokenizer", "does not exist"],
    ),
    "reprocess malformed input": (
        ["reprocess", "ht!tp://x/r", "{tmp}/store/out", "filter:score_min=0.5"],
        ["INPUT_RUN", "unknown storage protocol"],
    ),
    "reprocess unknown op": (
        ["reprocess", "{tmp}/store/sampled", "{tmp}/store/out", "shuffle"],
        ["'shuffle'", "use one of filter"],
    ),
    "reprocess bad argument": (
        ["reprocess", "{tmp}/store/sampled", "{tmp}/store/out", "filter:score_min=high"],
        ["score_min", "valid number"],
    ),
    "reprocess empty input": (
        ["reprocess", "{tmp}/store/none", "{tmp}/store/out", "filter:score_min=0.5"],
        ["holds no shards"],
    ),
    "shards ls malformed url": (["shards", "ls", "ht!tp://x/r"], ["URL", "unknown storage protocol"]),
    "shards verify missing": (["shards", "verify", "{tmp}/store/missing"], ["URL", "does not exist"]),
    "shards compact negative size": (
        ["shards", "compact", "{tmp}/store/sampled", "--target-mb", "-1"],
        ["--target-mb", "greater than or equal to 0.001"],
    ),
    "shards show bad index": (["shards", "show", "{tmp}/store/sampled", "--shard", "99"], ["--shard", "has 1 shards"]),
    "shards index malformed": (["shards", "index", "memory:/"], ["RUN_URL", "is not STORAGE_URL/RUN"]),
}


def filled(args: list[str], tmp: Path) -> list[str]:
    return [arg.format(tmp=tmp, model=cached_tiny_model()) for arg in args]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, work):
    args, phrases = CASES[case]
    before = files_under(work)
    result = CliRunner().invoke(app, filled(args, work), prog_name="clotho")
    line = the_error_line(result.exit_code, result.stdout, result.stderr)
    assert line.startswith(f"clotho {args[0]}"), line
    for phrase in phrases:
        assert phrase in line, (phrase, line)
    assert files_under(work) == before


# One per command, as users run it: the console script in a process of its own.
SUBPROCESS_CASES = [
    "run missing model",
    "rollout unknown env",
    "train negative lr",
    "serve missing model",
    "env check malformed server",
    "reprocess malformed input",
    "shards ls malformed url",
]


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_the_console_script_gives_one_line_and_exit_2(case, work):
    args, phrases = CASES[case]
    env = dict(os.environ, PREFECT_HOME=str(work / "prefect-home"), COLUMNS="80")
    env.pop("PREFECT_API_URL", None)
    before = files_under(work)
    done = subprocess.run([CLOTHO, *filled(args, work)], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    line = the_error_line(done.returncode, done.stdout, done.stderr)
    assert all(phrase in line for phrase in phrases), line
    assert files_under(work) == before  # the run, .clotho/ and Prefect's home included


@pytest.fixture
def other_tokenizer_run(work):
    """A run sampled with another tokenizer than the tiny model's (the tiny model of another seed:
    another BPE vocabulary), and one sampled with a copy of the tiny model's (same vocabulary, other path)."""
    other = cached_tiny_model(seed=1)
    with ShardWriter(str(work / "store"), "other", tokenizer=str(other), max_groups=2) as writer:
        writer.add_many(make_groups(2, seed=4))
    copy = work / "model-copy"
    shutil.copytree(cached_tiny_model(), copy)
    with ShardWriter(str(work / "store"), "copied", tokenizer=str(copy), max_groups=2) as writer:
        writer.add_many(make_groups(2, seed=5))
    return other


def test_shards_of_another_tokenizer_are_refused(work, other_tokenizer_run):
    from storage.reader import TokenizerMismatchError
    from trainer.data import check_run_tokenizer

    model = str(cached_tiny_model())
    before = files_under(work)
    result = CliRunner().invoke(
        app, prog_name="clotho", args=["train", "--run", f"{work}/store/other", "--model", model, "--steps", "1"]
    )
    line = the_error_line(result.exit_code, result.stdout, result.stderr)
    assert "--model" in line and f"tokenized with '{other_tokenizer_run}'" in line and "vocabulary differs" in line, (
        line
    )
    assert "train the model the run was sampled with" in line, line
    assert files_under(work) == before  # no trainer state, progress or checkpoint

    with pytest.raises(TokenizerMismatchError):
        check_run_tokenizer(str(work / "store"), "other", model)
    check_run_tokenizer(str(work / "store"), "copied", model)  # the same vocabulary at another path
    check_run_tokenizer(str(work / "store"), "sampled", model)  # the same name
    check_run_tokenizer(str(work / "store"), "other", str(other_tokenizer_run))  # its own model
    check_run_tokenizer(str(work / "store"), "empty", model)  # no shards yet

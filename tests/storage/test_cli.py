"""`clotho shards ls|show|verify|compact|index` against real shards on disk."""

from __future__ import annotations

import json
import shutil

import pytest
from rich.console import Console
from typer.testing import CliRunner

from clotho.testing.groups import make_groups
from core.scored_group import ScoredGroup, ScoredSequence
from storage import cli
from storage.reader import ShardReader
from storage.shard_file import find_shards
from storage.writer import ShardWriter

runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch) -> None:
    monkeypatch.setattr(cli, "console", Console(width=300, no_color=True))


@pytest.fixture
def run_url(tmp_path) -> str:
    with ShardWriter(f"file://{tmp_path}", "run", tokenizer="tok", max_groups=2) as writer:
        for group in make_groups(5, seed=41):
            writer.add(group)
    return f"file://{tmp_path}/run"


def invoke(*args: str):
    return runner.invoke(cli.shards_app, list(args))


def test_ls_lists_shards_with_counts_and_bytes(run_url: str) -> None:
    result = invoke("ls", run_url)
    assert result.exit_code == 0, result.output
    _, shards = find_shards(run_url)
    for shard in shards:
        assert shard.name in result.output and f"{shard.size:,}" in result.output
    assert "3 shards" in result.output and "│ 5 " in result.output and "│ 20 " in result.output


def test_show_prints_a_group_with_ids(run_url: str) -> None:
    result = invoke("show", run_url, "--group", "1")
    assert result.exit_code == 0, result.output
    group = list(ShardReader(run_url.rsplit("/", 1)[0], "run").groups())[1]
    assert group.group_id in result.output and "score" in result.output
    assert " ".join(map(str, group.sequences[0].tokens[:5])) in result.output
    assert invoke("show", run_url, "--group", "9").exit_code != 0


@pytest.mark.slow  # importing transformers takes seconds
def test_show_decodes_text_and_highlights_the_trained_part(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(["[UNK]", "what", "is", "two", "plus", "four", "."])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path / "tokenizer")
    sequence = ScoredSequence.from_prompt([1, 2, 3, 4, 3], [5, 6], [-0.5, -0.25], score=1.0)
    with ShardWriter(str(tmp_path), "run", tokenizer=str(tmp_path / "tokenizer")) as writer:
        writer.add(ScoredGroup(env="math", item_id="q1", sequences=[sequence]))
    cli.console = Console(width=300, force_terminal=True, color_system="standard")
    result = invoke("show", f"{tmp_path}/run", "--tokenizer", str(tmp_path / "tokenizer"))
    assert result.exit_code == 0, result.output
    assert "what is two plus two" in result.output
    assert "\x1b[1;32mfour .\x1b[0m" in result.output  # the completion, bold green; the prompt is not


def test_verify_passes_good_shards_and_fails_a_bad_one(run_url: str, tmp_path) -> None:
    result = invoke("verify", run_url)
    assert result.exit_code == 0, result.output
    assert "3 shards checked, 0 with problems" in result.output
    shard = find_shards(run_url)[1][1]
    with open(shard.path, "r+b") as file:
        file.truncate(shard.size - 10)
    result = invoke("verify", run_url)
    assert result.exit_code == 1
    assert "1 with problems" in result.output and "1 problem " in result.output
    # The problem is one whole line below the table, whatever the path's length or the terminal's width.
    [line] = [line for line in result.output.splitlines() if "not a readable Parquet file" in line]
    assert line.startswith(f"file://{shard.path}: not a readable Parquet file"), line


def test_compact_merges_and_keeps_rows(run_url: str) -> None:
    result = invoke("compact", run_url)
    assert result.exit_code == 0, result.output
    assert "1 merged shards written" in result.output
    assert json.loads(json.dumps(invoke("ls", run_url).output.count("parquet"))) == 1
    assert len(list(ShardReader(run_url.rsplit("/", 1)[0], "run").groups())) == 5


def test_index_makes_shards_copied_in_by_hand_readable(run_url: str, tmp_path) -> None:
    copy = tmp_path / "copy" / "run"
    (copy / "rollouts").parent.mkdir(parents=True)
    shutil.copytree(run_url.removeprefix("file://") + "/rollouts", copy / "rollouts")  # not its _index
    reader = ShardReader(f"file://{tmp_path}/copy", "run")
    assert len(list(reader.groups())) == 5  # a run without an index is indexed by its first reader
    shutil.copy(
        sorted((copy / "rollouts").rglob("*.parquet"))[0],  # the oldest: 2 groups
        copy / "rollouts" / "env=gsm8k" / "policy_version=0" / "20000101T000000.000000000Z-000000000000.parquet",
    )
    assert len(list(ShardReader(f"file://{tmp_path}/copy", "run").groups())) == 5  # not indexed yet
    result = invoke("index", f"file://{copy}")
    assert result.exit_code == 0 and "every shard is indexed" in result.output, result.output
    assert len(list(ShardReader(f"file://{tmp_path}/copy", "run").groups())) == 5 + 2

"""The DeepSpeed trainer end to end, as real processes: train, publish, log, resume after SIGKILL,
two ranks. Each run is a fresh `python -m trainer.cli` (DeepSpeed state is per process)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.scored_group import new_group_id
from storage.checkpoints import checkpoint_url, fetch_checkpoint, latest_checkpoint, published_steps, read_checkpoint
from storage.ledger import Ledger
from storage.progress import SamplerPosition, read_sampler_positions, read_trainer_position, write_sampler_position
from storage.shard_file import find_shards
from storage.weight_delta import DELTA_FILE, WEIGHTS_FILE
from tests.trainer.rollouts import sampled_groups, write_shards
from trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def trainer_args(root: str, run: str, model: Path, steps: int, *settings: str) -> list[str]:
    args = ["--run", f"{root}/{run}", "--model", str(model), "--steps", str(steps)]
    args += ["--data-timeout-s", "120", "--set", "lr=1e-3", "--set", "groups_per_step=2"]
    return args + [part for setting in settings for part in ("--set", setting)]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_trainer(args: list[str], launcher: list[str] | None = None, timeout: float = 240) -> str:
    command = (launcher or [sys.executable]) + ["-m", "trainer.cli", *args]
    done = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{output[-4000:]}"
    return output


def weights(checkpoint_url: str, cache: Path | None = None) -> dict[str, torch.Tensor]:
    """A published step's weights (a delta step's rebuilt from its chain)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="clotho-weights-") as scratch:
        local = fetch_checkpoint(read_checkpoint(checkpoint_url), cache or Path(scratch))
        return load_file(local / WEIGHTS_FILE)


def test_deltas_between_full_checkpoints_publish_the_same_weights_in_a_few_percent_of_the_bytes(
    tmp_path, tiny_model_dir
):
    """bf16 at lr 1e-6: a full checkpoint every 3, deltas between; every step fetched is, byte for
    byte, what a run publishing in full wrote, and a delta is under 10% of a full step's weights."""
    root = str(tmp_path)
    groups = sampled_groups(tiny_model_dir, 8, seed=31)
    settings = (
        "save_every=1",
        "lr=1e-6",
        "publish_dtype=bfloat16",
        "state_every=4",
        "max_lag=8",
        "keep_last=null",
    )
    for run, full_every in (("deltas", 3), ("full", 1)):
        write_shards(root, run, groups, groups_per_shard=2)
        run_trainer(trainer_args(root, run, tiny_model_dir, 4, *settings, f"full_every={full_every}"))
    chains = {step: read_checkpoint(checkpoint_url(root, "deltas", step)).chain for step in range(1, 5)}
    assert chains == {1: [], 2: [1], 3: [1, 2], 4: []}
    for step in range(1, 5):
        ours = fetch_checkpoint(read_checkpoint(checkpoint_url(root, "deltas", step)), tmp_path / "cache")
        theirs = Path(checkpoint_url(root, "full", step))
        assert (ours / WEIGHTS_FILE).read_bytes() == (theirs / WEIGHTS_FILE).read_bytes(), step
    full_bytes = read_checkpoint(checkpoint_url(root, "full", 2)).manifest["files"][WEIGHTS_FILE]
    delta_bytes = read_checkpoint(checkpoint_url(root, "deltas", 2)).manifest["files"][DELTA_FILE]
    assert delta_bytes < 0.1 * full_bytes, (delta_bytes, full_bytes)


def test_trains_publishes_and_logs(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    root = str(tmp_path)
    # Step 1 trains on two version-0 groups and publishes version 1; with max_lag 0 the
    # next version-0 group is then stale, and step 2 takes version 1's.
    write_shards(root, "run", sampled_groups(tiny_model_dir, 2, seed=1), groups_per_shard=2)
    write_shards(root, "run", sampled_groups(tiny_model_dir, 1, seed=2), groups_per_shard=1)
    later = sampled_groups(tiny_model_dir, 2, seed=3, policy_version=1)
    write_shards(root, "run", later, groups_per_shard=2)

    # A rollout flow that ended: its slot is the samplers' to take over; the trainer writes only its own file.
    ended = SamplerPosition("ended-flow", committed=5, in_flight=0, holder="ended-flow", closed=True)
    write_sampler_position(root, "run", ended)
    settings = ("save_every=1", "max_lag=0", "loss.kl_coef=0.01", "keep_last=1")
    run_trainer(trainer_args(root, "run", tiny_model_dir, 2, *settings))
    assert read_sampler_positions(root, "run") == [ended]
    position = read_trainer_position(root, "run")
    assert (position.steps, position.groups_consumed, position.policy_version, position.end_step) == (2, 5, 2, 2)

    first, second = read_metrics(tmp_path / "run" / "trainer")
    assert (first["step"], first["stale_groups_skipped"], first["groups"]) == (1, 0, 2)
    assert (second["step"], second["stale_groups_skipped"], second["groups"]) == (2, 1, 2)
    assert second["policy_version"] == 1 and second["staleness_max"] == 0
    # Sampler logprobs are the base model's: the first step's ratios are 1 up to float noise.
    assert abs(first["importance_weight_mean"] - 1) < 1e-5 and first["clip_fraction"] == 0
    for name in ("loss", "score_mean", "advantage_std", "grad_norm", "kl", "tokens_per_s", "padding_waste"):
        assert name in second
    # What each step paid beside its update (both steps published): a publish and a resume state.
    assert all(0 < row["publish_s"] < 60 and 0 < row["save_state_s"] < 60 for row in (first, second))
    assert first["kl"] == 0 and second["kl"] > 0  # to the frozen base model
    assert list((tmp_path / "run" / "trainer" / "tensorboard").glob("events.out.tfevents.*"))

    latest = latest_checkpoint(root, "run")
    # At lr 1e-3 every fp32 weight moves: no delta halves the bytes, so step 2 is full, and
    # keep_last=1 deleted step 1.
    assert latest.step == 2 and latest.chain == [] and published_steps(root, "run") == [2]
    assert (tmp_path / "run" / "checkpoints" / "LATEST").read_text() == "step-00000002"
    assert len(latest.manifest["ledger"]["consumed"]) == 3 and not latest.manifest["ledger"]["partial"]
    trained, base = weights(latest.url), load_file(tiny_model_dir / "model.safetensors")
    assert max((trained[k] - base[k]).abs().max().item() for k in base) > 1e-4
    model = AutoModelForCausalLM.from_pretrained(latest.url, dtype=torch.float32)
    torch.testing.assert_close(model.lm_head.weight.detach(), trained["lm_head.weight"])


def test_trains_with_a_custom_loss_chosen_by_import_path(tmp_path, tiny_model_dir):
    # The loss lives in a test module, not in trainer/: its own metrics reach the log.
    root = str(tmp_path)
    write_shards(root, "run", sampled_groups(tiny_model_dir, 2, seed=4), groups_per_shard=2)
    loss = ("loss.name=tests.trainer.custom_loss:reinforce", "loss.options.scale=2.0")
    run_trainer(trainer_args(root, "run", tiny_model_dir, 1, *loss))

    [step] = read_metrics(tmp_path / "run" / "trainer")
    assert step["reinforce_scale"] == 2.0 and abs(step["reinforce_weight_mean"] - 1) < 1e-5
    assert "clip_fraction" not in step  # the built-in losses' metrics: grpo did not run
    assert step["num_tokens"] > 0 and step["grad_norm"] > 0
    trained = weights(latest_checkpoint(root, "run").url)
    base = load_file(tiny_model_dir / "model.safetensors")
    assert max((trained[k] - base[k]).abs().max().item() for k in base) > 1e-4


def test_a_run_mixing_four_objectives_lowers_each_loss(tmp_path, tiny_model_dir):
    # Every step takes the same groups (copies with new ids) of all four objectives: two sampled
    # GRPO groups, two demonstrations, two DPO pairs without stored reference logprobs (the trainer
    # loads its reference model) and two distillation groups. Each objective's loss falls.
    from tests.trainer.test_preference_and_distillation import demonstrations, distill_groups, pairs

    root = str(tmp_path)
    groups = sampled_groups(tiny_model_dir, 2, seed=12) + demonstrations(2) + pairs(tiny_model_dir, 2, seed=5)
    groups += distill_groups(tiny_model_dir, 2, seed=6)
    steps = [[group.model_copy(update={"group_id": new_group_id()}) for group in groups] for _ in range(6)]
    write_shards(root, "run", [group for step in steps for group in step], groups_per_shard=8)
    run_trainer(trainer_args(root, "run", tiny_model_dir, 6, "groups_per_step=8", "max_lag=100"))

    history = read_metrics(tmp_path / "run" / "trainer")
    first, last = history[0], history[-1]
    assert (first["groups"], first["sft/groups"], first["dpo/groups"], first["distill/groups"]) == (8, 2, 2, 2)
    assert last["sft/nll"] < 0.8 * first["sft/nll"]
    assert last["rl/loss"] < first["rl/loss"] - 0.01
    assert last["dpo/loss"] < first["dpo/loss"] - 0.01 and last["dpo/accuracy"] == 1.0
    assert first["dpo/loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as its own reference
    assert last["distill/loss"] < first["distill/loss"] - 0.01
    assert first["loss"] == pytest.approx(
        sum(0.25 * first[f"{name}/loss"] for name in ("rl", "sft", "dpo", "distill")), abs=1e-5
    )


def test_a_resumed_run_takes_the_learning_rate_of_its_config(tmp_path, tiny_model_dir):
    # A pipeline phase resumes the run's optimizer state with its own lr; the saved one must not win.
    root = str(tmp_path)
    write_shards(root, "run", sampled_groups(tiny_model_dir, 8, seed=3), groups_per_shard=2)
    run_trainer(trainer_args(root, "run", tiny_model_dir, 2, "max_lag=100"))
    run_trainer(trainer_args(root, "run", tiny_model_dir, 4, "max_lag=100", "lr=2e-4"))
    history = read_metrics(tmp_path / "run" / "trainer")
    assert [(row["step"], row["lr"]) for row in history] == [(1, 1e-3), (2, 1e-3), (3, 2e-4), (4, 2e-4)]


def test_latest_is_replaced_whole_and_a_save_cut_short_is_never_resumed_from(tmp_path, tiny_model_dir):
    """The soak once killed a trainer while DeepSpeed wrote `latest` in place (truncate, then write):
    the empty file left no state to resume from. `latest` is now a new file renamed over the old
    one, written after every rank's files; a newer state dir it does not name (a save cut short
    before that rename) is not resumed from and is removed."""
    root = str(tmp_path)
    state = tmp_path / "run" / "trainer" / "state"
    write_shards(root, "run", sampled_groups(tiny_model_dir, 8, seed=3), groups_per_shard=2)
    run_trainer(trainer_args(root, "run", tiny_model_dir, 2, "max_lag=100"))
    first = (state / "latest").stat().st_ino
    assert (state / "latest").read_text() == "step-00000002"
    cut_short = state / "step-00000003"
    cut_short.mkdir()
    (cut_short / "mp_rank_00_model_states.pt").write_bytes(b"a save cut short")
    output = run_trainer(trainer_args(root, "run", tiny_model_dir, 4, "max_lag=100"))
    assert "resuming from step 2" in output
    assert (state / "latest").read_text() == "step-00000004" and (state / "latest").stat().st_ino != first
    assert sorted(p.name for p in state.iterdir()) == ["latest", "step-00000002", "step-00000004"]
    # Written without the zip records' CRC-32s (torch.load never checks them; 2-3 s a GB to compute).
    records = [info for saved in (state / "step-00000004").glob("*.pt") for info in zipfile.ZipFile(saved).infolist()]
    assert records and all(info.CRC == 0 for info in records)


def test_zip_checksums_are_off_only_while_a_state_is_saved():
    from trainer.resume_state import without_zip_checksums

    assert torch.serialization.get_crc32_options()
    with pytest.raises(RuntimeError), without_zip_checksums():
        assert not torch.serialization.get_crc32_options()
        raise RuntimeError("a save that fails")
    assert torch.serialization.get_crc32_options()  # what else the process saves keeps them


def test_with_the_state_in_storage_a_local_state_the_store_lacks_is_not_resumed_from(tmp_path, tiny_model_dir):
    """The store is the authority: a state saved on this host whose upload never completed (the
    cluster trials killed node 0's host right after a local save, and node 1, with nothing on its
    disk, could not agree with rank 0 resuming from it) is dropped and the run starts afresh."""
    root = str(tmp_path)
    state = tmp_path / "host-c" / "state"
    write_shards(root, "run", sampled_groups(tiny_model_dir, 8, seed=5), groups_per_shard=2)
    settings = ("state_in_storage=true", "max_lag=100")
    run_trainer([*trainer_args(root, "run", tiny_model_dir, 2, *settings), "--work-dir", str(tmp_path / "host-c")])
    assert (state / "latest").read_text() == "step-00000002"
    shutil.rmtree(tmp_path / "run" / "trainer-state")  # its upload never completed
    output = run_trainer(
        [*trainer_args(root, "run", tiny_model_dir, 3, *settings), "--work-dir", str(tmp_path / "host-c")]
    )
    assert "starting from step 0" in output and "resuming" not in output, output[-3000:]
    assert (tmp_path / "run" / "trainer-state" / "LATEST").read_text() == "step-00000003"


@pytest.mark.slow
def test_resume_after_kill_matches_an_uninterrupted_run(tmp_path, tiny_model_dir):
    """6 steps in one go vs 3 steps, SIGKILL, resume to 6: same shards consumed, same weights.

    Steps take 2 groups and save every 3. Phase one has 8 version-0 groups (2 shards of 4): steps
    1-3 use 6 of them, leaving a shard half read; after publishing version 3 the last 2 are stale.
    The killed trainer waits in step 4 for more data; phase two adds 6 version-3 groups.
    """
    root = str(tmp_path)
    settings = ("save_every=3", "max_lag=1")
    phase_one = sampled_groups(tiny_model_dir, 8, seed=10)
    phase_two = sampled_groups(tiny_model_dir, 6, seed=11, policy_version=3)

    write_shards(root, "killed", phase_one, groups_per_shard=4)
    log_path = tmp_path / "killed.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainer.cli", *trainer_args(root, "killed", tiny_model_dir, 6, *settings)],
            cwd=REPO,
            env=environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while "waiting for groups" not in log_path.read_text():
            assert process.poll() is None, f"trainer exited early:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no step 4 wait:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.2)
        assert (tmp_path / "killed" / "trainer" / "state" / "latest").read_text() == "step-00000003"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    write_shards(root, "killed", phase_two, groups_per_shard=4)
    # The same shards, file names included, for the uninterrupted run.
    shutil.copytree(tmp_path / "killed" / "rollouts", tmp_path / "whole" / "rollouts")

    run_trainer(trainer_args(root, "whole", tiny_model_dir, 6, *settings))
    output = run_trainer(trainer_args(root, "killed", tiny_model_dir, 6, *settings))
    assert "resuming from step 3" in output

    whole, resumed = latest_checkpoint(root, "whole"), latest_checkpoint(root, "killed")
    assert whole.step == resumed.step == 6
    # The same shards consumed (the watermarks trail each run's own clock by the grace period).
    ledgers = [Ledger.from_dict(c.manifest["ledger"]) for c in (whole, resumed)]
    names = [s.name for s in find_shards(f"{root}/killed")[1]]
    assert [ledgers[0].is_consumed(n) for n in names] == [ledgers[1].is_consumed(n) for n in names] == [True] * 4
    assert ledgers[0].partial == ledgers[1].partial == {}
    expected, actual = weights(whole.url), weights(resumed.url)
    assert max((expected[k] - actual[k]).abs().max().item() for k in expected) <= 1e-5
    # Step by step: the same data, losses and skips (steps 1-3 before the kill, 4-6 after).
    whole_steps = read_metrics(tmp_path / "whole" / "trainer")
    killed_steps = read_metrics(tmp_path / "killed" / "trainer")
    assert [m["step"] for m in killed_steps] == [m["step"] for m in whole_steps] == [1, 2, 3, 4, 5, 6]
    assert [m["stale_groups_skipped"] for m in whole_steps] == [0, 0, 0, 2, 0, 0]
    assert [m["stale_groups_skipped"] for m in killed_steps] == [0, 0, 0, 2, 0, 0]
    assert [m["loss"] for m in killed_steps] == pytest.approx([m["loss"] for m in whole_steps], abs=1e-7)


@pytest.mark.slow
def test_killed_between_resume_states_it_trains_the_steps_since_again_to_the_published_weights(
    tmp_path, tiny_model_dir
):
    """Checkpoints every step, the last one kept, resume state every 3: killed waiting in step 6
    (step 5 published, 1-4 deleted by retention, state at 3), it resumes at 3 and trains 4-5 again
    from the same groups: 4, deleted, is not published again (LATEST never goes back), 5 gives its
    published weights (checked against their stored logprobs), and it ends where an uninterrupted
    run ends."""
    root = str(tmp_path)
    settings = ("save_every=1", "state_every=3", "max_lag=8", "keep_last=1")
    write_shards(root, "killed", sampled_groups(tiny_model_dir, 10, seed=12), groups_per_shard=2)
    log_path = tmp_path / "killed.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainer.cli", *trainer_args(root, "killed", tiny_model_dir, 6, *settings)],
            cwd=REPO,
            env=environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while "waiting for groups" not in log_path.read_text():
            assert process.poll() is None, f"trainer exited early:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no step 6 wait:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.2)
        state = tmp_path / "killed" / "trainer" / "state"
        assert published_steps(root, "killed") == [5]
        assert (state / "latest").read_text() == "step-00000003"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    write_shards(root, "killed", sampled_groups(tiny_model_dir, 2, seed=13), groups_per_shard=2)
    shutil.copytree(tmp_path / "killed" / "rollouts", tmp_path / "whole" / "rollouts")

    run_trainer(trainer_args(root, "whole", tiny_model_dir, 6, *settings))
    output = run_trainer(trainer_args(root, "killed", tiny_model_dir, 6, *settings))
    assert "resuming from step 3" in output
    assert output.count("step-00000004 was published and retention deleted it: not published again") == 1
    assert output.count("the step trained again gives its stored logprobs") == 1, output[-4000:]
    assert published_steps(root, "killed") == [6]
    assert sorted(p.name for p in state.glob("step-*")) == ["step-00000003", "step-00000006"]
    expected, actual = weights(latest_checkpoint(root, "whole").url), weights(latest_checkpoint(root, "killed").url)
    assert max((expected[k] - actual[k]).abs().max().item() for k in expected) <= 1e-6
    whole_steps = read_metrics(tmp_path / "whole" / "trainer")
    assert [m["step"] for m in whole_steps if "save_state_s" in m] == [3, 6]  # not every step
    killed_steps = {m["step"]: m for m in read_metrics(tmp_path / "killed" / "trainer")}  # the rows trained last
    assert [killed_steps[m["step"]]["loss"] for m in whole_steps] == pytest.approx(
        [m["loss"] for m in whole_steps], abs=1e-7
    )


@pytest.mark.slow
def test_rerun_after_dying_between_publish_and_state_save(tmp_path, tiny_model_dir):
    """A trainer that published step 2 but died before saving its step-2 state resumes from step
    1, trains step 2 again to the same result and leaves the published checkpoint as it is."""
    root = str(tmp_path)
    write_shards(root, "run", sampled_groups(tiny_model_dir, 4, seed=50), groups_per_shard=4)
    args = trainer_args(root, "run", tiny_model_dir, 2, "save_every=1")
    run_trainer(args)
    published = latest_checkpoint(root, "run")
    state = tmp_path / "run" / "trainer" / "state"
    shutil.rmtree(state / "step-00000002")
    (state / "latest").write_text("step-00000001")

    output = run_trainer(args)
    assert "resuming from step 1" in output and "is already published" in output
    assert latest_checkpoint(root, "run").manifest == published.manifest
    first, second = [m for m in read_metrics(tmp_path / "run" / "trainer") if m["step"] == 2]
    assert second["loss"] == pytest.approx(first["loss"], abs=1e-7)
    # The retrained weights (in the new resume state) are the published ones.
    retrained = torch.load(state / "step-00000002" / "mp_rank_00_model_states.pt", weights_only=False)
    expected = weights(published.url)
    assert max((retrained["module"][k] - expected[k]).abs().max().item() for k in expected) <= 1e-6


@pytest.mark.slow
@pytest.mark.integration
def test_two_ranks_train_and_publish(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    root = str(tmp_path)
    write_shards(root, "run", sampled_groups(tiny_model_dir, 4, seed=20), groups_per_shard=4)
    launcher = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2"]
    # torchrun needs `--` before the trainer's options (it would read --run as its --run-path).
    output = run_trainer(["--", *trainer_args(root, "run", tiny_model_dir, 2)], launcher=launcher)
    assert "on 2 rank(s)" in output

    latest = latest_checkpoint(root, "run")
    assert latest.step == 2 and len(read_metrics(tmp_path / "run" / "trainer")) == 2
    model = AutoModelForCausalLM.from_pretrained(latest.url, dtype=torch.float32)
    base = load_file(tiny_model_dir / "model.safetensors")
    assert (model.lm_head.weight.detach() - base["lm_head.weight"]).abs().max() > 1e-4


@pytest.mark.slow
@pytest.mark.integration
def test_two_ranks_resume_together_from_a_shared_work_dir_or_from_storage_on_a_new_disk(tmp_path, tiny_model_dir):
    """Both ranks read rank 0's resume state (one work dir on a disk they share) and go on from it;
    on a disk that has none (a new host's), from the copy in the run's storage (state_in_storage):
    one rank per host fetches it. Ranks on hosts that share no disk and have no copy in storage stop
    with an error instead (tests/cluster)."""
    root = str(tmp_path)
    write_shards(root, "run", sampled_groups(tiny_model_dir, 6, seed=21), groups_per_shard=6)
    launcher = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2"]
    disk, new_disk = ["--work-dir", str(tmp_path / "host-c")], ["--work-dir", str(tmp_path / "host-d")]
    run_trainer(
        ["--", *trainer_args(root, "run", tiny_model_dir, 1, "state_in_storage=true", "max_lag=8"), *disk],
        launcher=launcher,
    )
    output = run_trainer(
        ["--", *trainer_args(root, "run", tiny_model_dir, 2, "state_in_storage=true", "max_lag=8"), *disk],
        launcher=launcher,
    )
    assert "on 2 rank(s)" in output and "resuming from step 1" in output, output[-3000:]
    assert "fetched" not in output  # its own disk had it whole
    output = run_trainer(
        ["--", *trainer_args(root, "run", tiny_model_dir, 3, "state_in_storage=true", "max_lag=8"), *new_disk],
        launcher=launcher,
    )
    assert output.count("resume state step-00000002 fetched") == 1 and "resuming from step 2" in output, output[-3000:]
    assert latest_checkpoint(root, "run").step == 3
    assert read_trainer_position(root, "run").groups_consumed == 6  # each group once across the three
    assert (tmp_path / "run" / "trainer-state" / "LATEST").read_text() == "step-00000003"


@pytest.mark.slow
@pytest.mark.integration
async def test_published_checkpoint_serves_in_vllm(tmp_path):
    """A trained checkpoint of the tied-embedding model (the case that needs an explicit lm_head)
    serves in vLLM with transformers' logprobs, and they are the trained weights', not the base's."""
    from inference.client import PolicyClient
    from inference.parity import load_reference_model, max_abs_difference, read_parity_reference, reference_logprobs
    from inference.parity_guard import ParityGuard
    from inference.server import PolicyServer
    from tests.conftest import cached_tiny_model, worker_log

    base = cached_tiny_model(tie_embeddings=True)
    root = str(tmp_path)
    write_shards(root, "run", sampled_groups(base, 2, seed=30), groups_per_shard=2)
    run_trainer(trainer_args(root, "run", base, 1, "lr=1e-2"))
    checkpoint = Path(latest_checkpoint(root, "run").url)

    # The trainer stored the checkpoint's own logprobs of the guard's sequences: the files' own.
    sequences, stored = read_parity_reference(checkpoint)
    reference_model = load_reference_model(checkpoint)
    for sequence, logprobs in zip(sequences, stored, strict=True):
        assert max_abs_difference(logprobs, reference_logprobs(reference_model, sequence[:1], sequence[1:])) < 1e-5

    prompt = list(range(40, 52))
    guard = ParityGuard.for_model(base)
    with PolicyServer(checkpoint, log_path=worker_log("vllm-trained-checkpoint")) as server:
        async with PolicyClient(server.base_url) as client:
            [completion] = await client.complete(prompt, max_tokens=16, temperature=0.0)
            report = await guard.check(client, checkpoint)  # three requests against the stored reference
    assert report.reference == "stored" and report.max_difference < 1e-4 and not guard._models
    trained = reference_logprobs(reference_model, prompt, completion.token_ids)
    assert max_abs_difference(completion.logprobs, trained) < 1e-4
    untrained = reference_logprobs(load_reference_model(base), prompt, completion.token_ids)
    assert max_abs_difference(completion.logprobs, untrained) > 1e-3

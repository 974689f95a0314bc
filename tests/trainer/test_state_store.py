"""The resume state in the run's storage (trainer.state_store): each rank uploads the files it wrote,
rank 0 marks the state complete and the newest complete one is what a trainer resumes from; a
host fetches it once, keeps a whole local copy and replaces a partial one."""

from __future__ import annotations

from pathlib import Path

from trainer.state_store import StateStore, writer_rank


def saved(state_dir: Path, tag: str, files: dict[str, bytes]) -> Path:
    for name, body in files.items():
        (state_dir / tag / name).parent.mkdir(parents=True, exist_ok=True)
        (state_dir / tag / name).write_bytes(body)
    return state_dir / tag


def save(store: StateStore, state_dir: Path, tag: str, files: dict[str, bytes], ranks: int = 2) -> None:
    tag_dir = saved(state_dir, tag, files)
    uploaded = [store.upload(tag_dir, rank) for rank in range(ranks)]
    store.commit(tag, {name: size for files in uploaded for name, size in files.items()}, keep=2)


def test_each_rank_uploads_its_own_files_and_the_newest_complete_state_is_the_one(tmp_path):
    assert [
        writer_rank(n)
        for n in (
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt",
        )
    ] == [0, 1, 12]
    store = StateStore(f"file://{tmp_path}/storage", "run")
    assert store.latest() is None
    files = {
        "mp_rank_00_model_states.pt": b"model",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"o0",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": b"opt1",
    }
    tag_dir = saved(tmp_path / "host-c", "step-00000002", files)
    assert store.upload(tag_dir, 1) == {"zero_pp_rank_1_mp_rank_00_optim_states.pt": 4}
    assert store.latest() is None  # uploaded, not complete: never resumed from
    store.commit("step-00000002", {**store.upload(tag_dir, 0), "zero_pp_rank_1_mp_rank_00_optim_states.pt": 4}, keep=2)
    assert store.latest() == ("step-00000002", {name: len(body) for name, body in files.items()})
    for step in (4, 6):
        save(store, tmp_path / "host-c", f"step-{step:08d}", files)
    stored = tmp_path / "storage" / "run" / "trainer-state"
    assert sorted(p.name for p in stored.iterdir()) == ["LATEST", "step-00000004", "step-00000006"]  # the newest 2
    # A state uploaded but not complete when its trainer died does not count.
    saved(tmp_path / "host-c", "step-00000008", files)
    store.upload(tmp_path / "host-c" / "step-00000008", 0)
    assert store.latest()[0] == "step-00000006"


def test_a_host_fetches_the_stored_state_once_and_points_latest_at_it(tmp_path):
    store = StateStore(f"file://{tmp_path}/storage", "run")
    files = {"mp_rank_00_model_states.pt": b"model-6"}
    save(store, tmp_path / "host-c", "step-00000006", files, ranks=1)
    tag, listed = store.latest()
    host_d = tmp_path / "host-d"
    host_d.mkdir()
    assert store.fetch(tag, listed, host_d) is True
    assert (host_d / "step-00000006" / "mp_rank_00_model_states.pt").read_bytes() == b"model-6"
    assert (host_d / "latest").read_text() == "step-00000006" and not list(host_d.glob(".*partial*"))
    assert store.fetch(tag, listed, host_d) is False  # whole already: nothing downloaded
    # A host whose newer local state never completed in storage resumes from the stored one; a
    # partial local copy of the stored tag is replaced.
    saved(tmp_path / "host-c", "step-00000008", files)
    (tmp_path / "host-c" / "latest").write_text("step-00000008")
    (tmp_path / "host-c" / "step-00000006" / "mp_rank_00_model_states.pt").write_bytes(b"cut")
    assert store.fetch(tag, listed, tmp_path / "host-c") is True
    assert (tmp_path / "host-c" / "latest").read_text() == "step-00000006"
    assert (tmp_path / "host-c" / "step-00000006" / "mp_rank_00_model_states.pt").read_bytes() == b"model-6"
    assert (
        StateStore.for_run(f"file://{tmp_path}/storage", "run", None) is None
    )  # a local run's work dir is in its storage
    assert StateStore.for_run(f"file://{tmp_path}/storage", "run", True) == store

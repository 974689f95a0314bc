"""The resume state: DeepSpeed's model, optimizer and scheduler state plus the trainer's own (step,
shard ledger, RNG of every rank), for an exact resume.

`{work_dir}/state/step-{N:08d}/` on local disk, the last KEEP_STATES kept. With `state_in_storage`
(by default when the run's storage is remote) it is also copied to `{root}/{run}/trainer-state/`
(trainer.state_store), the copy every rank on any host resumes from. The state goes with every
`state_every`-th step or every `state_every_minutes`, after the step's publish: a trainer killed
later resumes from the newest state and trains the steps since again (trainer.publishing).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from storage.checkpoints import step_name
from trainer.distributed import broadcast_object, gather_objects
from trainer.state_store import StateStore, StateUpload, point_latest

log = logging.getLogger(__name__)

KEEP_STATES = 2
STATE_FORMAT = 1


def rng_state() -> dict[str, Any]:
    """This process's random number generator states (python, numpy, torch, CUDA)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_resume_state(
    engine,
    state_dir: Path,
    step: int,
    trainer_state: dict[str, Any],
    rng_states: list[Any],
    store: StateStore | None = None,
) -> StateUpload | None:
    """DeepSpeed checkpoint of step N with `trainer_state` and every rank's RNG (call on every
    rank), then all but the newest KEEP_STATES dropped on rank 0. With a `store`, returns this
    rank's upload of its files, under way on a thread (commit_resume_state makes it count); the
    caller settles an earlier one first."""
    client_state = {"format": STATE_FORMAT, "trainer": trainer_state, "rng": rng_states}
    tag = step_name(step)
    # DeepSpeed's own `latest` is written by truncating and writing the file: a trainer killed in
    # between left an empty one, which no trainer could resume from. Every rank's files first, then
    # rank 0 points `latest` at them in one rename.
    with without_zip_checksums():
        engine.save_checkpoint(str(state_dir), tag=tag, client_state=client_state, save_latest=False)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        point_latest(state_dir, tag)
        # None is newer than this one: load_resume_state dropped what a save cut short left.
        for old in sorted(p for p in state_dir.glob("step-*") if p.is_dir())[:-KEEP_STATES]:
            shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()
    return StateUpload(store, state_dir / tag, torch.distributed.get_rank(), step) if store is not None else None


@contextmanager
def without_zip_checksums() -> Iterator[None]:
    """torch.save without the CRC-32 of each record of its zip file, which torch.load never checks:
    2-3 s a GB here (a 0.5B model's state is 5.9 GB, 8.6 s a save with them). A torn or partial
    state is told by `latest`, moved only once every file is written, not by these."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def commit_resume_state(upload: StateUpload, wait: bool) -> bool:
    """Once every rank's upload of a resume state is done, rank 0 marks it complete in the store
    (call on every rank, at the same point of the same step). Returns whether it was committed;
    without `wait`, False while any rank's is still under way. An upload's error is raised here."""
    world_size = torch.distributed.get_world_size()
    if not wait and not all(gather_objects(upload.done(), world_size)):  # every rank passes the same `wait`
        return False
    try:
        files, error = upload.result(), None
    except Exception as raised:  # noqa: BLE001 - every rank hears of it, or the others would wait for this one
        files, error = {}, raised
    uploaded = gather_objects((files, None if error is None else str(error)), world_size)
    if error is not None:
        raise error
    if failed := [f"rank {rank}: {why}" for rank, (_, why) in enumerate(uploaded) if why is not None]:
        raise RuntimeError(
            f"resume state {step_name(upload.step)} not uploaded to {upload.store.url}: {'; '.join(failed)}"
        )
    if torch.distributed.get_rank() == 0:
        upload.store.commit(
            step_name(upload.step),
            {name: size for files, _ in uploaded for name, size in files.items()},
            keep=KEEP_STATES,
        )
    torch.distributed.barrier()
    return True


def fetch_resume_state(state_dir: Path, store: StateStore) -> str | None:
    """The newest resume state in `store` into `state_dir` on every host that lacks it (one rank per
    host fetches; call on every rank), and DeepSpeed's `latest` pointed at it: the state every rank
    resumes from, even where a newer one was saved locally and never completed in storage. Returns
    its tag; None (and nothing changed) when the store has none."""
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    stored = broadcast_object(store.latest() if torch.distributed.get_rank() == 0 else None, world_size)
    if stored is None:
        return None
    tag, files = stored
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        state_dir.mkdir(parents=True, exist_ok=True)
        store.fetch(tag, files, state_dir)
    torch.distributed.barrier()
    return tag


def agreed_resume_tag(state_dir: Path) -> str | None:
    """The resume state every rank resumes from (`latest`'s tag, rank 0's), or None when rank 0
    has none (a fresh run). Call on every rank.

    Rank 0 alone writes `latest` and, at ZeRO 0, the model and optimizer files every rank loads.
    Ranks on hosts that do not share the work dir would otherwise part ways: rank 0 resuming at step
    N, a rank on another host starting afresh from the base weights, the replicas apart and the
    loops soon waiting on each other. A rank that cannot read the state `latest` names is an error
    naming the ranks and hosts."""
    latest = state_dir / "latest"
    tag = latest.read_text().strip() if latest.exists() else None
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    readable = bool(tag) and any((state_dir / str(tag)).glob("*model_states.pt"))
    held = [(socket.gethostname(), tag, readable)]
    if world_size > 1:
        held = gather_objects(held[0], world_size)
    _, authority, _ = held[0]
    if authority is None:
        return None
    missing = [
        f"rank {rank} on {host}" for rank, (host, theirs, has) in enumerate(held) if not has or theirs != authority
    ]
    if missing:
        shared = (
            "ranks on several hosts resume only from a work dir they share (--work-dir on a shared file system); "
            if world_size > 1
            else ""
        )
        raise RuntimeError(
            f"{state_dir}: rank 0 on {held[0][0]} resumes from {authority}, which "
            f"{', '.join(missing)} cannot read there: {shared}or move the work dirs away to start the run afresh"
        )
    return authority


def drop_states_after(state_dir: Path, tag: str | None) -> None:
    """Remove this host's resume states newer than `tag` (all of them and `latest` when None): saves
    cut short, or states that never became complete in the store (once on each host)."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0 or not state_dir.is_dir():
        return
    for newer in (p for p in state_dir.glob("step-*") if p.is_dir() and (tag is None or p.name > tag)):
        log.info("removing %s: a resume state that never became the one to resume from", newer)
        shutil.rmtree(newer, ignore_errors=True)
    if tag is None:
        (state_dir / "latest").unlink(missing_ok=True)


def load_resume_state(engine, state_dir: Path, lr: float, store: StateStore | None = None) -> dict[str, Any] | None:
    """Restore the newest resume state into `engine` and this rank's RNG, with learning rate `lr`
    (the config's, not the saved one); returns the trainer state saved with it, or None for a fresh
    run: `state_dir` has none or, with a `store`, the store has none complete. The store is the
    authority where there is one: its state is fetched into `state_dir` first, and a host's local
    state newer than it (or any, when it has none) was never complete for every rank."""
    if store is not None and fetch_resume_state(state_dir, store) is None:
        drop_states_after(state_dir, None)
        torch.distributed.barrier()  # every rank has dropped its host's before any starts afresh
        return None
    tag = agreed_resume_tag(state_dir)
    drop_states_after(state_dir, tag)
    if tag is None:
        return None
    path, client_state = engine.load_checkpoint(str(state_dir), tag=tag)
    if path is None or client_state.get("format") != STATE_FORMAT:
        raise RuntimeError(
            f"{state_dir}: resume state unreadable (format {client_state.get('format')!r}, "
            f"expected {STATE_FORMAT}); move the directory away to start the run afresh"
        )
    # The optimizer's saved state carries the learning rate it ran with; the config's is the one to
    # use now (a pipeline phase or a resumed run may set another one).
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rng_states = client_state["rng"]
    if len(rng_states) == world_size:
        set_rng_state(rng_states[rank])
    else:
        log.warning(
            "resume state saved by %d ranks, running %d: random generators start fresh",
            len(rng_states),
            world_size,
        )
    return client_state["trainer"]

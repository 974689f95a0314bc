"""Where a run stands, for bounded staleness: the trainer's position (steps whose data it took,
groups consumed, the newest published version, its batch and staleness settings), each sampler's
counts (groups committed to shards, groups in flight) and, when a pipeline's stop rule ended the
run early, the step it ended at.

    {root}/{run}/progress/trainer.json          the trainer's: as it starts, after every read and publish
    {root}/{run}/progress/samplers/{slot}.json  the rollout flow holding the slot, as its counts change
    {root}/{run}/progress/claims/{slot}@{N}     who claimed the slot's N-th generation, written once
    {root}/{run}/progress/end.json              the pipeline's (`clotho run`), when its stop rule held
    {root}/{run}/metrics/step-{N:08d}.json      the trainer's metrics of step N (rank 0, after the step)

Each file has one writer. A sampler's file is a slot: a rollout flow that starts takes over a slot
whose holder closed or died (stopped writing for `DEAD_AFTER_S`), carrying its committed count on,
and makes a new one only when none is free. So the samplers' directory holds as many files as the
run ever had flows at once, not one per flow run, and nothing ever removes another part's file.
Small JSON documents, replaced whole (a PUT on object stores, a rename on local disks), so a reader
sees the old or the new one, never half. Reading them costs the same at step 10 and at step 10**6:
none grows with the run's history. The step metrics are one small document per step, read by
name (the next step's) by whoever follows the run from another host (`clotho run` does), never listed.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from storage.filesystem import is_local, publish, resolve, retrying, storage_errors
from storage.layout import TEMPORARY, join, run_url

PROGRESS = "progress"
TRAINER_FILE = "trainer.json"
SAMPLERS = "samplers"
CLAIMS = "claims"
END_FILE = "end.json"
METRICS = "metrics"


@dataclass(frozen=True)
class TrainerPosition:
    """The trainer as the samplers see it. `steps`: steps whose groups it has taken (it may still
    be training the last one); `groups_consumed`: every group it read, trained or skipped as stale;
    `policy_version`: the newest version it published; then the settings the admission rule needs."""

    steps: int
    groups_consumed: int
    policy_version: int
    groups_per_step: int
    save_every: int
    max_lag: int
    # The step this trainer trains up to (its --steps): a sampler that samples for a later phase
    # waits for that phase's trainer (None: no end, a trainer run without --steps).
    end_step: int | None = None
    updated_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class SamplerPosition:
    """One sampler slot: `committed`, the groups its holders committed to shards (the ones before
    the present holder included), `in_flight` admitted by the holder and not yet in a shard
    (sampling, or buffered in its writer). A holder that stopped updating is dead: its in-flight
    groups will never arrive, its committed ones did."""

    sampler: str  # the slot: its file's name
    committed: int
    in_flight: int
    holder: str  # the rollout flow writing the slot
    closed: bool = False  # its holder's flow ended: it never writes again, the slot is free
    updated_at: float = field(default_factory=time.time)
    adopted: int = 0  # of `committed`, what the holder took over from the slot's previous holders
    generation: int = 0  # claims of the slot so far (claim_sampler_slot): the holder's, in each write

    def free(self, now: float) -> bool:
        """Whether a starting sampler may take the slot over: its holder closed, or died."""
        return self.closed or now - self.updated_at > DEAD_AFTER_S


DEAD_AFTER_S = 60.0  # a sampler that has not written its position for this long is dead


def trainer_position_url(root: str, run: str) -> str:
    return join(run_url(root, run), PROGRESS, TRAINER_FILE)


def sampler_position_url(root: str, run: str, sampler: str) -> str:
    if not sampler or "/" in sampler:
        raise ValueError(f"sampler {sampler!r}: use a non-empty name without '/'")
    return join(run_url(root, run), PROGRESS, SAMPLERS, f"{sampler}.json")


def write_trainer_position(
    root: str, run: str, position: TrainerPosition, *, storage_options: dict[str, Any] | None = None
) -> None:
    replace_json(trainer_position_url(root, run), asdict(position), storage_options)


def announce_trainer(
    root: str,
    run: str,
    *,
    groups_per_step: int,
    save_every: int,
    max_lag: int,
    end_step: int,
    storage_options: dict[str, Any] | None = None,
) -> TrainerPosition:
    """A starting trainer's first word, before it loads anything: where the run stands (its last
    published position, step 0 for a new run) with this trainer's settings and end, so the samplers
    of its steps sample while it loads. Once loaded it writes its own resumed position."""
    known = read_trainer_position(root, run, storage_options=storage_options)
    position = TrainerPosition(
        steps=known.steps if known else 0,
        groups_consumed=known.groups_consumed if known else 0,
        policy_version=known.policy_version if known else 0,
        groups_per_step=groups_per_step,
        save_every=save_every,
        max_lag=max_lag,
        end_step=end_step,
    )
    write_trainer_position(root, run, position, storage_options=storage_options)
    return position


def read_trainer_position(
    root: str, run: str, *, storage_options: dict[str, Any] | None = None
) -> TrainerPosition | None:
    """The trainer's last position; None before a trainer (or the pipeline) wrote one."""
    data = read_json(trainer_position_url(root, run), storage_options)
    return None if data is None else _load(TrainerPosition, data, trainer_position_url(root, run))


def write_sampler_position(
    root: str, run: str, position: SamplerPosition, *, storage_options: dict[str, Any] | None = None
) -> None:
    replace_json(sampler_position_url(root, run, position.sampler), asdict(position), storage_options)


def read_sampler_position(
    root: str, run: str, slot: str, *, storage_options: dict[str, Any] | None = None
) -> SamplerPosition | None:
    url = sampler_position_url(root, run, slot)
    data = read_json(url, storage_options)
    return None if data is None else _load(SamplerPosition, data, url)


def read_sampler_positions(
    root: str, run: str, *, storage_options: dict[str, Any] | None = None
) -> list[SamplerPosition]:
    """Every sampler slot's last position."""
    url = join(run_url(root, run), PROGRESS, SAMPLERS)
    fs, path = resolve(url, storage_options)
    with storage_errors(url):
        try:
            names = [name for name in retrying(fs, path, fs.ls, path, detail=False) if name.endswith(".json")]
        except FileNotFoundError:
            return []
        positions = []
        for name in names:
            try:
                data = json.loads(retrying(fs, name, fs.cat_file, name))
            except FileNotFoundError:
                continue
            positions.append(_load(SamplerPosition, data, name))
    return positions


def groups_committed(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> int:
    """Every group the run's samplers committed to shards."""
    return sum(position.committed for position in read_sampler_positions(root, run, storage_options=storage_options))


def claim_url(root: str, run: str, slot: str, generation: int) -> str:
    return join(run_url(root, run), PROGRESS, CLAIMS, f"{slot}@{generation:08d}")


def claim_sampler_slot(
    root: str, run: str, holder: str, *, storage_options: dict[str, Any] | None = None
) -> SamplerPosition:
    """A slot for the sampler `holder`: the first free one (its committed count carried on), or a
    new slot named after the holder when none is free.

    A free slot is taken by claiming its next generation: a write of
    `progress/claims/{slot}@{generation}` that fails when the file exists (storage.filesystem.publish:
    a hard link on a local disk, `If-None-Match: *` on S3, a lock on memory://). Of flows that race
    for one slot, one writes the claim and holds the slot; the others try the next one. So two flows
    never hold one slot, and nothing is repaired afterwards. A claimant that dies between its claim
    and its first write leaves that slot to no one: its counts stay counted, later flows use others."""
    for slot in sorted(
        (p for p in read_sampler_positions(root, run, storage_options=storage_options) if p.free(time.time())),
        key=lambda p: p.sampler,
    ):
        generation = slot.generation + 1
        if not _claim(root, run, slot.sampler, generation, holder, storage_options):
            continue  # another flow took it first
        claimed = SamplerPosition(
            slot.sampler, slot.committed, 0, holder=holder, adopted=slot.committed, generation=generation
        )
        write_sampler_position(root, run, claimed, storage_options=storage_options)
        if slot.generation:  # the claim before this one: nobody races for it any more
            url = claim_url(root, run, slot.sampler, slot.generation)
            fs, path = resolve(url, storage_options)
            with contextlib.suppress(FileNotFoundError), storage_errors(url):
                retrying(fs, path, fs.rm, path)
        return claimed
    claimed = SamplerPosition(holder, 0, 0, holder=holder)
    write_sampler_position(root, run, claimed, storage_options=storage_options)
    return claimed


def _claim(
    root: str, run: str, slot: str, generation: int, holder: str, storage_options: dict[str, Any] | None
) -> bool:
    url = claim_url(root, run, slot, generation)
    fs, path = resolve(url, storage_options)
    temp_dir = resolve(join(run_url(root, run), TEMPORARY), storage_options)[1]
    with storage_errors(url):
        try:
            publish(fs, path, json.dumps({"holder": holder, "at": time.time()}).encode(), temp_dir=temp_dir)
        except FileExistsError:
            return False
    return True


def end_url(root: str, run: str) -> str:
    return join(run_url(root, run), PROGRESS, END_FILE)


def write_run_end(root: str, run: str, last_step: int, *, storage_options: dict[str, Any] | None = None) -> None:
    """The run ends at `last_step` (a pipeline's stop rule held): its samplers sample nothing that
    only a later step would train, and end. Written by the pipeline only."""
    replace_json(end_url(root, run), {"last_step": last_step, "updated_at": time.time()}, storage_options)


def read_run_end(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> int | None:
    data = read_json(end_url(root, run), storage_options)
    return None if data is None else int(data["last_step"])


def clear_run_end(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> None:
    """A pipeline that resumes a run it ended early takes its end back before its samplers start."""
    url = end_url(root, run)
    fs, path = resolve(url, storage_options)
    with storage_errors(url), contextlib.suppress(FileNotFoundError):
        fs.rm(path)


def step_metrics_url(root: str, run: str, step: int) -> str:
    return join(run_url(root, run), METRICS, f"step-{step:08d}.json")


def write_step_metrics(
    root: str, run: str, row: dict[str, Any], *, storage_options: dict[str, Any] | None = None
) -> None:
    """Step `row["step"]`'s metrics row (the line the trainer appends to its metrics.jsonl), where a
    reader on any host finds it: a trainer on other hosts than the pipeline's shares no disk with it."""
    replace_json(step_metrics_url(root, run, int(row["step"])), row, storage_options)


def read_step_metrics(
    root: str, run: str, step: int, *, storage_options: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Step `step`'s metrics row; None before the trainer finished the step."""
    return read_json(step_metrics_url(root, run, step), storage_options)


def _load(cls, data: dict[str, Any], where: str):
    try:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
    except TypeError as error:
        raise ValueError(f"{where}: not a {cls.__name__} ({error}); delete it to start over") from None


def replace_json(url: str, data: dict[str, Any], storage_options: dict[str, Any] | None) -> None:
    """Replace the small JSON document at `url` whole: readers see the old or the new one."""
    fs, path = resolve(url, storage_options)
    body = json.dumps(data).encode()
    with storage_errors(url):
        if is_local(fs):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temp = f"{path}.{os.getpid()}.{os.urandom(3).hex()}.tmp"
            with open(temp, "wb") as file:
                file.write(body)
            os.replace(temp, path)  # atomic on one file system: readers see old or new
        else:
            retrying(fs, path, fs.pipe_file, path, body)  # one PUT: atomic on object stores


def read_json(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The small JSON document at `url` (replace_json's), or None where there is none."""
    fs, path = resolve(url, storage_options)
    with storage_errors(url):
        try:
            return json.loads(retrying(fs, path, fs.cat_file, path))
        except FileNotFoundError:
            return None

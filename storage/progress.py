"""Where a run stands, for bounded staleness: the trainer's position (steps whose data it took,
groups consumed, the newest published version, its batch and staleness settings) and each
sampler's counts (groups committed to shards, groups in flight).

    {root}/{run}/progress/trainer.json             written by the trainer after every read and publish
    {root}/{run}/progress/samplers/{sampler}.json  written by each rollout flow as its counts change

A sampler's file stays until its flow closes and the trainer folds its count into its own
(`retired_committed`), so the samplers' directory holds the live samplers, not every flow run the
run ever had. Small JSON documents, each with one writer (the trainer also removes closed
samplers' files), replaced whole (a PUT on object stores, a rename on
local disks), so a reader sees the old or the new one, never half. Reading them costs the same at
step 10 and at step 10**6: none grows with the run's history.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from storage.filesystem import is_local, resolve, retrying, storage_errors
from storage.layout import join, run_url

PROGRESS = "progress"
TRAINER_FILE = "trainer.json"
SAMPLERS = "samplers"


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
    max_staleness: int
    # Groups committed by samplers that closed and whose files the trainer removed (folded here so
    # the samplers' directory holds the live ones only: a poll reads it whole).
    retired_committed: int = 0
    updated_at: float = field(default_factory=time.time)
    # The run's last step when it ended before its configured end (a pipeline's stop rule, written
    # once the trainer is stopped): the samplers sample nothing past it and end.
    last_step: int | None = None


@dataclass(frozen=True)
class SamplerPosition:
    """One rollout flow's groups: `committed` to shards since it started, `in_flight` admitted and
    not yet in a shard (sampling, or buffered in its writer). A sampler that stopped updating is
    dead: its in-flight groups will never arrive, its committed ones did. A closed one is folded
    into the trainer's `retired_committed` and its file removed (`retire_closed_samplers`)."""

    sampler: str
    committed: int
    in_flight: int
    closed: bool = False  # its flow ended: it never writes again, so the trainer may retire it
    updated_at: float = field(default_factory=time.time)


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


def read_trainer_position(
    root: str, run: str, *, storage_options: dict[str, Any] | None = None
) -> TrainerPosition | None:
    """The trainer's last position; None before a trainer (or the pipeline) wrote one."""
    data = _read(trainer_position_url(root, run), storage_options)
    return None if data is None else _load(TrainerPosition, data, trainer_position_url(root, run))


def write_sampler_position(
    root: str, run: str, position: SamplerPosition, *, storage_options: dict[str, Any] | None = None
) -> None:
    replace_json(sampler_position_url(root, run, position.sampler), asdict(position), storage_options)


def read_sampler_positions(
    root: str, run: str, *, storage_options: dict[str, Any] | None = None
) -> list[SamplerPosition]:
    """Every sampler's last position (one file per rollout flow run that ever sampled this run)."""
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
    """Every group the run's samplers committed to shards: the live ones' and the retired ones'."""
    live = sum(position.committed for position in read_sampler_positions(root, run, storage_options=storage_options))
    trainer = read_trainer_position(root, run, storage_options=storage_options)
    return live + (trainer.retired_committed if trainer is not None else 0)


def retire_closed_samplers(
    root: str, run: str, *, storage_options: dict[str, Any] | None = None
) -> list[SamplerPosition]:
    """The closed samplers' positions, to fold into the trainer's `retired_committed`; the trainer
    saves that, publishes its position, and only then calls `remove_sampler_positions` on them
    (a sampler reading in between counts them twice: it admits less for a moment, never more)."""
    return [position for position in read_sampler_positions(root, run, storage_options=storage_options) if position.closed]


def remove_sampler_positions(
    root: str, run: str, samplers: list[str], *, storage_options: dict[str, Any] | None = None
) -> None:
    for sampler in samplers:
        url = sampler_position_url(root, run, sampler)
        fs, path = resolve(url, storage_options)
        with storage_errors(url), contextlib.suppress(FileNotFoundError):
            fs.rm(path)


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


def _read(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    fs, path = resolve(url, storage_options)
    with storage_errors(url):
        try:
            return json.loads(retrying(fs, path, fs.cat_file, path))
        except FileNotFoundError:
            return None

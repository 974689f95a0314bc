"""What a trial checks once the killed part is back: read from the run's files and the servers,
never from the parts' own claims.

- committed groups: every group of every readable shard under `rollouts/` (a shard is committed
  once it is visible there: it is published whole, by a link or an exclusive PUT);
- torn: a file under `rollouts/` that is not a readable, valid shard (a temporary file, half a
  shard), or a group id held by two shards;
- trained: the groups each step took, from the ledger saved in each published checkpoint's STABLE
  manifest (step k took what ledger k holds and ledger k-1 does not): a group in two steps was
  trained twice, a committed group in none was lost, and a ledger that forgets a group it held
  would let a later step take it again;
- the weights: a fresh trainer replays the same shards uninterrupted (`replay`), and every
  published step must hold the same weights and the same groups;
- the servers: not paused, announcing the newest step, and serving its weights (parity against a
  transformers forward pass of that checkpoint).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.checkpoints import (
    checkpoint_url,
    fetch_checkpoint,
    published_steps,
    read_checkpoint,
    step_directories,
    step_name,
)
from storage.filesystem import list_files, relative, resolve
from storage.index import id_at, index_shards, list_entries
from storage.layout import ROLLOUTS, is_hidden, join, parse_shard_name, split_run_url
from storage.ledger import Ledger
from storage.progress import read_step_metrics
from storage.schema import table_to_groups
from storage.shard_file import ShardInfo, read_shard
from storage.weight_delta import WEIGHTS_FILE


@dataclass(frozen=True)
class StoredGroup:
    shard: str  # env=E/policy_version=V/ID.parquet
    index: int  # position in its shard
    group_id: str
    item_id: str
    scores: list[float]


@dataclass
class Storage:
    """The run's shards as a reader finds them, and what is wrong with them."""

    groups: list[StoredGroup] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)  # unreadable shards, stray files, doubled group ids
    orphan_entries: int = 0  # index entries whose shard never appeared (a writer killed in between)

    @property
    def by_shard(self) -> dict[str, list[StoredGroup]]:
        shards: dict[str, list[StoredGroup]] = {}
        for group in self.groups:
            shards.setdefault(group.shard, []).append(group)
        return shards

    @property
    def ids(self) -> set[str]:
        return {group.group_id for group in self.groups}

    @property
    def item_ids(self) -> set[str]:
        return {group.item_id for group in self.groups}


def read_storage(run_url: str) -> Storage:
    """Every file under the run's rollouts/, read whole: shards decoded and checked, anything else torn."""
    fs, run_path = resolve(run_url)
    rollouts = join(run_path, ROLLOUTS)
    found = Storage()
    holder: dict[str, str] = {}
    for path in sorted(list_files(fs, rollouts)):
        name = relative(path, rollouts)
        location = parse_shard_name(name)
        if is_hidden(name) or location is None:
            found.torn.append(f"{name}: not a shard, yet visible in rollouts/")
            continue
        try:
            groups = table_to_groups(read_shard(fs, ShardInfo(join(run_url, ROLLOUTS, name), path, location, None)))
        except Exception as error:  # noqa: BLE001 - whatever fails to read is torn
            found.torn.append(f"{name}: unreadable ({type(error).__name__}: {error})")
            continue
        for index, group in enumerate(groups):
            if group.group_id in holder:
                found.torn.append(f"group {group.group_id} is in {holder[group.group_id]} and in {name}")
            holder[group.group_id] = name
            found.groups.append(StoredGroup(location.name, index, group.group_id, group.item_id, group.scores))
    shards = {group.shard for group in found.groups}
    entries = list_entries(fs, run_path)
    found.orphan_entries = sum(1 for entry in entries if entry.location.name not in shards)
    return found


def orphan_entries_since(run_url: str, since: float) -> list[str]:
    """Index entries stamped after `since` (time.time()) whose shard is not there: what a writer
    killed between creating a shard's entry and publishing the shard leaves behind."""
    fs, run_path = resolve(run_url)
    return [
        entry.shard_id
        for entry in list_entries(fs, run_path, after=id_at(since))
        if not fs.exists(join(run_path, ROLLOUTS, entry.location.name))
    ]


def consumed(ledger: Ledger, storage: Storage) -> set[str]:
    """The group ids the ledger holds as handed to the trainer."""
    taken = set()
    for shard, groups in storage.by_shard.items():
        count = len(groups) if ledger.is_consumed(shard) else ledger.groups_taken(shard)
        taken.update(group.group_id for group in groups[:count])
    return taken


@dataclass
class Training:
    """Per published step, the groups it took (ledger k less ledger k-1)."""

    steps: dict[int, set[str]]
    regressions: list[str]  # steps whose ledger lost a group an earlier one held

    def times_trained(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for taken in self.steps.values():
            for group_id in taken:
                counts[group_id] = counts.get(group_id, 0) + 1
        return counts


def read_training(run_url: str, storage: Storage, up_to: int | None = None) -> Training:
    root, run = split_run_url(run_url)
    steps: dict[int, set[str]] = {}
    regressions = []
    previous: set[str] = set()
    for step in published_steps(root, run):
        if up_to is not None and step > up_to:
            break
        manifest = read_checkpoint(checkpoint_url(root, run, step)).manifest
        now = consumed(Ledger.from_dict(manifest.get("ledger") or {}), storage)
        if previous - now:
            regressions.append(f"step {step}'s ledger lost {len(previous - now)} groups step {step - 1}'s held")
        steps[step] = now - previous
        previous = now
    return Training(steps, regressions)


@dataclass
class Tally:
    """One check of the run: what is wrong with the groups committed so far."""

    committed: int
    lost: set[str]  # committed, taken by no step
    twice: set[str]  # taken by more than one step
    torn: set[str]
    wrong_steps: list[str]  # ledgers that forgot groups; steps that took other than groups_per_step
    orphan_entries: int
    misscored: set[str]  # members scored other than planned (see misscored)


def unstable_checkpoints(run_url: str, up_to_step: int) -> list[str]:
    """Step directories up to `up_to_step` without STABLE: half a checkpoint (readers skip it, but
    a trainer that trained the step again must have published it whole)."""
    root, run = split_run_url(run_url)
    return [
        f"checkpoints/{step_name(step)} has no STABLE"
        for step, stable in sorted(step_directories(root, run))
        if step <= up_to_step and not stable
    ]


def misscored(groups: Iterable[tuple[str, list[float]]], planned: Callable[[str], list[float]]) -> list[str]:
    """Stored groups whose scores are not the planned ones: `item_id member M: scored X, must be Y`."""
    wrong = []
    for item_id, scores in groups:
        for member, (score, must) in enumerate(zip(scores, planned(item_id), strict=True)):
            if abs(score - must) > 1e-9:
                wrong.append(f"{item_id} member {member}: scored {score:g}, must be {must:g}")
    return wrong


def tally(
    run_url: str, up_to_step: int, groups_per_step: int, planned: Callable[[str], list[float]] | None = None
) -> Tally:
    """`planned`: an item id's planned scores, to check every stored group's against (None: none checked)."""
    storage = read_storage(run_url)
    storage.torn += unstable_checkpoints(run_url, up_to_step)
    training = read_training(run_url, storage, up_to=up_to_step)
    counts = training.times_trained()
    wrong = [f"step {step} was never published" for step in range(1, up_to_step + 1) if step not in training.steps]
    wrong += [
        f"step {step} took {len(taken)} groups"
        for step, taken in training.steps.items()
        if len(taken) != groups_per_step
    ]
    return Tally(
        committed=len(storage.groups),
        lost=storage.ids - set(counts),
        twice={group for group, times in counts.items() if times > 1},
        torn=set(storage.torn),
        wrong_steps=training.regressions + wrong,
        orphan_entries=storage.orphan_entries,
        misscored=set(misscored(((g.item_id, g.scores) for g in storage.groups), planned)) if planned else set(),
    )


def run_tally(run_url: str) -> dict[str, Any]:
    """A `clotho run`'s run checked from its files after it ended: every published step, the groups
    each took (its ledger less the last's) against the groups it read (its metrics row in storage:
    trained, skipped as stale, rejected), none taken twice, no torn shard or half checkpoint, no
    ledger that forgot a group. `lost`: groups a step's ledger holds beyond what the step read
    (consumed, never trained); `unread`: committed groups no step took, still there for a next one."""
    root, run = split_run_url(run_url)
    storage = read_storage(run_url)
    training = read_training(run_url, storage)
    torn = list(storage.torn) + unstable_checkpoints(run_url, max(training.steps, default=0))
    rows = {step: read_step_metrics(root, run, step) for step in training.steps}
    read = {
        step: None if row is None else int(row["groups"] + row["stale_groups_skipped"] + row.get("rejected_groups", 0))
        for step, row in rows.items()
    }
    counts = training.times_trained()
    return {
        "steps": sorted(training.steps),
        "committed": len(storage.groups),
        "took": {step: len(taken) for step, taken in training.steps.items()},
        "read": read,
        "stale": sum(int(row["stale_groups_skipped"]) for row in rows.values() if row is not None),
        "lost": sum(max(0, len(taken) - (read[step] or 0)) for step, taken in training.steps.items()),
        "unread": len(storage.ids - set(counts)),
        "twice": sum(times > 1 for times in counts.values()),
        "torn": torn,
        "regressions": training.regressions,
    }


# ---- the weights: an uninterrupted trainer over the same shards ------------------------------


def copy_shards(run_url: str, replay_run_url: str) -> int:
    """The run's committed shards, names included, into a fresh local run (`replay_run_url`, a
    file:// URL), indexed as a trainer finds them."""
    fs, source = resolve(join(run_url, ROLLOUTS))
    target = Path(resolve(replay_run_url)[1]) / ROLLOUTS
    for path in list_files(fs, source):
        destination = target / relative(path, source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(fs.cat_file(path))
    index_shards(replay_run_url)
    return sum(1 for _ in target.rglob("*.parquet"))


def checkpoint_weights(run_url: str, step: int):
    """Step N's weights (a delta step's rebuilt from its chain)."""
    import tempfile

    from safetensors.torch import load_file

    root, run = split_run_url(run_url)
    with tempfile.TemporaryDirectory(prefix="clotho-weights-") as cache:
        local = fetch_checkpoint(read_checkpoint(checkpoint_url(root, run, step)), cache)
        return load_file(local / WEIGHTS_FILE)


@dataclass
class Comparison:
    step: int
    same_groups: bool
    max_difference: float  # largest |killed - replayed| over every weight (0.0: bit for bit)
    equal: bool  # every tensor bitwise equal


def compare_runs(run_url: str, replay_run_url: str, steps: int) -> list[Comparison]:
    """Step by step: the groups each run's ledger took, and the weights each published."""
    storage = read_storage(run_url)
    mine = read_training(run_url, storage, up_to=steps).steps
    theirs = read_training(replay_run_url, storage, up_to=steps).steps
    comparisons = []
    for step in range(1, steps + 1):
        first, second = checkpoint_weights(run_url, step), checkpoint_weights(replay_run_url, step)
        difference = max((first[name] - second[name]).abs().max().item() for name in first)
        equal = first.keys() == second.keys() and all(bool((first[n] == second[n]).all()) for n in first)
        comparisons.append(Comparison(step, mine.get(step) == theirs.get(step), difference, equal))
    return comparisons


# ---- the servers -----------------------------------------------------------------------------


@dataclass
class ServerState:
    paused: bool
    version: int
    parity: float | None  # max |served - checkpoint| logprob; None when not measured (paused)

    def problems(self, expected_version: int, tolerance: float) -> list[str]:
        found = []
        if self.paused:
            found.append("left paused")
        if self.version != expected_version:
            found.append(f"announces version {self.version}, the newest step is {expected_version}")
        if self.parity is not None and not self.parity <= tolerance:
            found.append(f"serves other weights than version {self.version} announces (parity {self.parity:.3g})")
        return found


async def server_state(base_url: str, run_url: str, guard, base_model: Path, cache_dir: Path) -> ServerState:
    """Paused or not, the announced version, and how far the served logprobs are from that
    version's checkpoint (the base model for version 0; a checkpoint on an object store is fetched
    into `cache_dir` first)."""
    from inference.client import PolicyClient

    root, run = split_run_url(run_url)
    async with PolicyClient(base_url, max_retries=2, backoff=0.2) as client:
        paused = bool((await client.request("GET", "/is_paused")).json().get("is_paused"))
        version = await client.weight_version()
        if paused:
            return ServerState(True, version, None)
        weights = base_model
        if version > 0:
            checkpoint = read_checkpoint(checkpoint_url(root, run, version))
            weights = await asyncio.to_thread(fetch_checkpoint, checkpoint, cache_dir)
        report = await guard.measure(client, weights)
    return ServerState(False, version, report.max_difference)


# ---- what the Prefect UI shows ----------------------------------------------------------------


def flow_run_states(api_url: str, run_url: str) -> dict[str, int]:
    """How many of the rollout flow runs that wrote `run_url` the Prefect server shows in each
    state (a SIGKILLed flow cannot report its end: it shows Running until someone marks it)."""
    import httpx

    body = {"flows": {"name": {"any_": ["rollout"]}}, "limit": 200}
    states: dict[str, int] = {}
    offset = 0
    while True:
        response = httpx.post(f"{api_url}/flow_runs/filter", json={**body, "offset": offset}, timeout=30)
        response.raise_for_status()
        runs = response.json()
        for flow_run in runs:
            if flow_run["parameters"].get("run_url") == run_url:
                state = flow_run["state"]["type"] if flow_run.get("state") else "NONE"
                states[state] = states.get(state, 0) + 1
        if len(runs) < body["limit"]:
            return states
        offset += len(runs)

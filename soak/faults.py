"""Fault trials against a running loop (soak.loop): SIGKILL one real process at a random moment,
restart it, and let the loop check the run once it has caught up.

One `Loop` per fault: a run, its trainer and reload watcher running across every trial, a policy
server and a Prefect server shared with the other faults (vLLM takes about a minute to start on two
cores). Somewhere in each trial's segment the fault kills its part, which is then started again.
For a killed rollout flow the trial also counts the finished groups it never committed, and how
old they were at the kill: the flush window bounds them.

When the kill lands, drawn from a seeded generator and recorded with each trial:
- rollout flow, Prefect server: three times in four while the flow samples and flushes, else
  anywhere in the flow's life (start-up and exit included);
- trainer: every fourth trial while it publishes a checkpoint; else three times in four inside
  one of the segment's steps (reading, training, publishing, saving its state), else anywhere in
  the segment (data waits included);
- reload watcher, vLLM: by turns at random in the segment; inside a reload (at the first
  /is_paused that says so, or in the parity check that follows the swap); and once the segment is
  trained and served, when nothing is left to reload.

Three faults stop or load instead of killing: `pause_in_reload` (SIGSTOP of vLLM mid-swap),
`hog_in_sandbox` and `hang_judge` (the scoring's machinery, against soak.graded's groups).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable

import httpx

from soak import checks
from soak.groups import read_journal
from soak.loop import Loop, Trial, estimate, wait_until, wait_version
from soak.parts import Part
from storage.checkpoints import STABLE, checkpoint_url, published_steps, step_directories
from storage.filesystem import resolve
from storage.layout import join

# ---- where a kill lands ------------------------------------------------------------------------


def trainer_phase(loop: Loop) -> str:
    """What the trainer just killed was doing, from its log and the files it left."""
    log = loop.trainer.log_since_start()
    if "rank(s); state in" not in log:
        return "starting"
    state = loop.trainer_dir / "state"
    try:
        saved = int((state / "latest").read_text().strip().rsplit("-", 1)[-1]) if (state / "latest").exists() else 0
    except ValueError:  # DeepSpeed is writing it
        return "saving its state"
    being_saved = [p for p in state.glob("step-*") if p.is_dir() and int(p.name.rsplit("-", 1)[-1]) > saved]
    published = newest_step(loop)
    # publish_step saves the weights to a staging directory, then uploads them as the step.
    if staging_now(loop):
        return "staging a checkpoint"
    if any(step > published for step, _ in step_directories(loop.root, loop.run)):
        return "publishing a checkpoint"
    if being_saved:
        return "saving its state"
    if published > saved:
        return "between publish and state save"
    last = [line for line in log.splitlines() if " trainer." in line or " storage." in line][-1:] or [""]
    return "waiting for data" if "waiting for groups" in last[0] else "reading data or training"


async def server_phase(loop: Loop) -> str:
    """What a server whose watcher was just killed is left doing."""
    newest = max(published_steps(loop.root, loop.run), default=0)
    state = await loop.server_state()
    if state.paused:
        return "mid-swap (left paused)"
    if state.parity is not None and state.parity > loop.parity_guard().tolerance:
        return "swapped, not announced"
    return "reload done" if state.version == newest else "between reloads"


async def watch_pause(base_url: str, until: float, paused: bool = True) -> bool:
    """Poll /is_paused every few ms until it says `paused` (True) or `until`: a swap of the tiny
    model pauses the server for a tenth of a second or so."""
    async with httpx.AsyncClient(base_url=base_url, timeout=2.0) as client:
        while time.monotonic() < until:
            try:
                if (await client.get("/is_paused")).json().get("is_paused") == paused:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.005)
    return False


def stable(loop: Loop, step: int) -> bool:
    """Whether step `step` is published (one stat or HEAD, cheap enough to poll)."""
    fs, path = resolve(join(checkpoint_url(loop.root, loop.run, step), STABLE))
    return fs.exists(path)


def new_checkpoint_moment(loop: Loop, timeout_s: float = 120.0) -> bool:
    """Wait for the next STABLE step of the run (True), or give up after timeout_s."""
    following = newest_step(loop) + 1
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stable(loop, following):
            return True
        time.sleep(0.01)
    return False


def kill_in_reload(loop: Loop, part, rng: random.Random) -> tuple[float, str] | None:
    """Kill `part` inside the reload of the next checkpoint: at the first /is_paused that says so
    (mid-swap) or, every other time, once the pause is over, at a random moment as long as the
    watcher's last parity check took (parity check, announcement). None when no checkpoint or
    pause came."""
    if not new_checkpoint_moment(loop):
        return None
    window = loop.settings.watcher_poll_s + 1.0
    paused = asyncio.run(watch_pause(loop.server_url, time.monotonic() + window + 5.0))
    if not paused:
        return None
    if rng.random() < 0.5:
        return part.kill(), "mid-swap"
    asyncio.run(watch_pause(loop.server_url, time.monotonic() + 10.0, paused=False))  # the swap's end
    wait_until(time.monotonic() + rng.uniform(0.0, last_parity_s(loop)))
    return part.kill(), "after the swap"


def last_parity_s(loop: Loop) -> float:
    """How long the watcher's last reload spent from the swap's end to the announcement (its log:
    'now serves version N: swap A, parity Bs'); 0.5 s before it logged one."""
    found = (
        re.findall(r"now serves version \d+: swap [\d.]+s, parity ([\d.]+)s", loop.watcher.log_tail(20_000))
        if loop.watcher
        else []
    )
    return float(found[-1]) + 0.05 if found else 0.5


def kill_serving_part(loop: Loop, part, trial: Trial, rng: random.Random) -> tuple[float, str]:
    """The watcher's and vLLM's kill moments, by turns: at random in the segment; inside a reload;
    after the segment is trained and served, while nothing is left to reload."""
    started = time.monotonic()
    loop.start_rollout(loop.goal() - loop.committed())
    mode = trial.trial % 3
    if mode == 2:
        killed = kill_in_reload(loop, part, rng)
        if killed is not None:
            return killed
    if mode == 0:
        loop.fill(trial.problems)
        loop.wait_trained()
        asyncio.run(wait_version(loop.server_url, loop.last_step(), timeout_s=loop.settings.segment_timeout_s))
        wait_until(time.monotonic() + rng.uniform(0.0, 2.0))
        return part.kill(), "idle, the newest version served"
    wait_until(started + rng.uniform(0.0, estimate(loop.segment_s, 15.0)))
    return part.kill(), "at random"


# ---- the faults ---------------------------------------------------------------------------


def kill_rollout(loop: Loop, trial: Trial, rng: random.Random) -> float | None:
    """SIGKILL the segment's rollout flow at a random moment of its life; measure what it lost."""
    part = loop.start_rollout(loop.goal() - loop.committed())
    if not wait_until(loop.rollout_kill_moment(part, rng), lambda: part.alive):
        trial.landed = "missed (the flow had finished)"
        return None
    killed_at = part.kill()
    finished = read_journal(part.journal)
    storage = checks.read_storage(loop.run_url)
    prefix = f"{part.seed}-"
    stored = {item for item in storage.item_ids if item.startswith(prefix)}
    uncommitted = {item: when for item, when in finished.items() if item not in stored}
    trial.uncommitted = len(uncommitted)
    trial.uncommitted_oldest_s = max((killed_at - when for when in uncommitted.values()), default=0.0)
    window = loop.settings.shard_max_age_s + 1.0 + 1.0  # the age, the flush timer's period, a flush's time
    if trial.uncommitted_oldest_s > window:
        trial.problems.append(
            f"a finished group waited {trial.uncommitted_oldest_s:.1f}s uncommitted (window {window:.0f}s)"
        )
    trial.landed = (
        "before its first group"
        if not finished
        else ("sampling" if len(finished) < part.groups_asked else "after its last group")
    )
    if checks.orphan_entries_since(loop.run_url, part.started_wall):  # readers wait storage.index.GRACE_S on it
        trial.landed += ", mid-flush (an index entry without its shard)"
    return killed_at


# The tiny model's whole step, training and publishing, takes about 50 ms on 2 cores: a kill later
# than this after staging starts lands once the publish is over.
PUBLISH_WINDOW_S = 0.03


def kill_trainer(loop: Loop, trial: Trial, rng: random.Random) -> float:
    """SIGKILL the trainer: every fourth trial while it publishes a checkpoint (within
    PUBLISH_WINDOW_S of its staging one: the save, the upload, STABLE, LATEST); else three
    times in four at a random moment of one of the segment's steps (reading, training,
    publishing, saving its state), else anywhere in the segment (a data wait)."""
    started = time.monotonic()
    first_step = loop.last_step() - loop.settings.steps_per_trial
    loop.start_rollout(loop.goal() - loop.committed())
    if trial.trial % 4 == 0 and wait_for_staging(loop, timeout_s=loop.settings.segment_timeout_s):
        wait_until(time.monotonic() + rng.uniform(0.0, PUBLISH_WINDOW_S))
    elif rng.random() < 0.75:
        steps_done = rng.randrange(loop.settings.steps_per_trial)
        period = step_period(loop)
        shards = loop.shard_count()
        while loop.shard_count() == shards or not (
            first_step + steps_done == 0 or stable(loop, first_step + steps_done)
        ):
            time.sleep(0.02)  # until this segment's data is there and the trainer is at the drawn step
        wait_until(time.monotonic() + rng.uniform(0.0, period))
    else:
        wait_until(started + rng.uniform(0.0, estimate(loop.segment_s, 15.0)))
    killed_at = loop.trainer.kill()
    # Read from what the dead trainer left (its log, staging directory, steps without STABLE):
    # reading them first would take longer than a publish lasts.
    trial.landed = trainer_phase(loop)
    loop.trainer.start()
    return killed_at


def staging_now(loop: Loop) -> bool:
    """Whether the running trainer is staging a checkpoint (trainer.publishing.publish_step)."""
    for path in loop.staging_dir.glob("clotho-checkpoint-*"):
        try:
            if path.stat().st_mtime >= loop.trainer.started_wall:  # not one a killed trainer left
                return True
        except FileNotFoundError:  # published and removed meanwhile
            pass
    return False


def wait_for_staging(loop: Loop, timeout_s: float) -> bool:
    """Until the trainer starts staging a checkpoint (True), or timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if staging_now(loop):
            return True
        time.sleep(0.005)
    return False


def newest_step(loop: Loop) -> int:
    return max(published_steps(loop.root, loop.run), default=0)


def step_period(loop: Loop) -> float:
    """Seconds from one publish to the next while the trainer had data: the shortest gap between
    the run's recent STABLE manifests (1 s before there are any)."""
    from storage.checkpoints import checkpoint_url, read_checkpoint

    steps = published_steps(loop.root, loop.run)[-10:]
    times = [read_checkpoint(checkpoint_url(loop.root, loop.run, step)).manifest["published_at"] for step in steps]
    gaps = [later - earlier for earlier, later in zip(times, times[1:]) if later > earlier]
    return min(gaps) if gaps else 1.0


def kill_watcher(loop: Loop, trial: Trial, rng: random.Random) -> float:
    """SIGKILL the reload watcher (see kill_serving_part for when); restart it."""
    killed_at, how = kill_serving_part(loop, loop.watcher, trial, rng)
    trial.landed = f"{how}: {asyncio.run(server_phase(loop))}"
    loop.watcher.start()
    return killed_at


def kill_vllm(loop: Loop, trial: Trial, rng: random.Random) -> float:
    """SIGKILL the policy server's processes (see kill_serving_part for when); restart it on
    the base model as a supervisor would: the watcher must bring it back to the run's version."""
    killed_at, trial.landed = kill_serving_part(loop, loop.policy, trial, rng)
    loop.policy.start()
    return killed_at


def pause_in_reload(loop: Loop, trial: Trial, rng: random.Random) -> float | None:
    """SIGSTOP the policy server's processes inside the reload of the next checkpoint (right after
    the watcher paused it), SIGCONT them a random 0.5 to 3 step timeouts later: shorter, the reload
    goes on; longer, the watcher gives it up within inference.reload.reload_bound_s and restores the
    server once it answers. Either way the server must serve the segment's steps again, never be
    left paused; `caught_up_s` (from the SIGSTOP) and `landed` say how it went."""
    loop.start_rollout(loop.goal() - loop.committed())
    if not new_checkpoint_moment(loop):
        return None
    if not asyncio.run(watch_pause(loop.server_url, time.monotonic() + loop.settings.watcher_poll_s + 6.0)):
        return None
    timeouts = rng.uniform(0.5, 3.0)
    stopped_at = loop.policy.pause(timeouts * loop.settings.reload_step_timeout_s)
    time.sleep(timeouts * loop.settings.reload_step_timeout_s)
    held = (
        "under a step timeout" if timeouts < 1 else "past the reload's bound" if timeouts > 2 else "1-2 step timeouts"
    )
    trial.landed = f"stopped mid-swap {held}"
    return stopped_at


def first_group(loop: Loop, trial: Trial) -> Part | None:
    """Start the segment's rollout flow and wait for its first finished group (None: it ended first)."""
    part = loop.start_rollout(loop.goal() - loop.committed())
    while part.alive and not read_journal(part.journal):
        time.sleep(0.05)
    if not read_journal(part.journal):
        trial.landed = "missed (the flow ended before its first group)"
        return None
    return part


def hog_in_sandbox(loop: Loop, trial: Trial, rng: random.Random) -> float | None:
    """While the flow's groups run in code_exec's sandbox, load the host (clotho.testing.cpu_hog:
    about a tenth of a core left to each program) for 3 to 20 s: starved runs are tried again, then
    their group fails as `infra`; every group stored must carry the scores its answers deserve."""
    from clotho.testing.cpu_hog import cpu_hog

    if first_group(loop, trial) is None:
        return None
    seconds = rng.uniform(3.0, 20.0)  # past ~12 s a group's three tries all starve
    started = time.time()
    with cpu_hog():
        time.sleep(seconds)
    trial.landed = "hog under 10 s" if seconds < 10 else "hog 10-20 s"
    return started


def hang_judge(loop: Loop, trial: Trial, rng: random.Random) -> float | None:
    """While the flow's groups are judged, the judge accepts requests and answers none for 0.5 to 8
    judge timeouts: shorter, a retry gets the score; longer, the tries run out and the group fails as
    `infra`; never a hang scored, never a joke dropped from its group."""
    if first_group(loop, trial) is None:
        return None
    timeouts = rng.uniform(0.5, 8.0)
    started = time.time()
    loop.judge.hang(timeouts * loop.settings.judge_timeout_s)
    time.sleep(timeouts * loop.settings.judge_timeout_s)
    trial.landed = "hung under 3 judge timeouts" if timeouts < 3 else "hung 3-8 judge timeouts"
    return started


def kill_prefect(loop: Loop, trial: Trial, rng: random.Random) -> float | None:
    """SIGKILL the Prefect server (all its processes) while a rollout flow runs; restart it after
    an outage of up to 5 s. The flow may carry on, fail or hang: what it committed must hold."""
    part = loop.start_rollout(loop.goal() - loop.committed())
    if not wait_until(loop.rollout_kill_moment(part, rng), lambda: part.alive):
        trial.landed = "missed (the flow had finished)"
        return None
    killed_at = loop.prefect.kill()
    wait_until(time.monotonic() + rng.uniform(0.0, 5.0))
    loop.prefect.start()
    code = part.wait(120.0)
    if code is None:
        part.kill()
    trial.landed = "flow survived" if code == 0 else ("flow hung, killed" if code is None else f"flow exited {code}")
    if code == 0:  # and what the UI says of it
        trial.landed += f", its flow run shows {flow_run_state(loop, part).lower()}"
    # Not killed itself, the flow must have committed every group it finished (its exit flushes).
    stored = {item for item in checks.read_storage(loop.run_url).item_ids if item.startswith(f"{part.seed}-")}
    trial.uncommitted = len(set(read_journal(part.journal)) - stored)
    if trial.uncommitted and code is not None:
        trial.problems.append(f"the flow exited with {trial.uncommitted} finished groups uncommitted")
    return killed_at


def flow_run_state(loop: Loop, part) -> str:
    """The state the Prefect server holds for a rollout flow run (its id is in the flow's log)."""
    found = re.findall(r"runs/flow-run/([0-9a-f-]{36})", part.log_since_start())
    if not found:
        return "unknown (no flow run id in its log)"
    response = httpx.get(f"{loop.prefect.api_url}/flow_runs/{found[-1]}", timeout=30)
    return response.json()["state"]["type"] if response.status_code == 200 else f"unknown ({response.status_code})"


FAULTS: dict[str, Callable[[Loop, Trial, random.Random], float | None]] = {
    "rollout flow": kill_rollout,
    "trainer": kill_trainer,
    "reload watcher": kill_watcher,
    "vLLM server": kill_vllm,
    "Prefect server": kill_prefect,
    "paused reload": pause_in_reload,
    "CPU hog in the sandbox": hog_in_sandbox,
    "hanging judge": hang_judge,
}


def run_trials(
    loop: Loop, fault: str, trials: int, rng: random.Random, log: Callable[[str], None] = print
) -> list[Trial]:
    """`trials` trials of one fault on a started loop (a trial whose kill missed is run again),
    then the replay. Returns the trials, each with its checks."""
    kill = FAULTS[fault]
    results: list[Trial] = []
    carried: list[str] = []  # problems of segments whose kill missed, reported with the next trial
    while len(results) < trials:
        trial = Trial(fault, len(results) + 1, problems=carried)
        started = time.monotonic()
        loop.begin_segment()
        trial.segment = loop.segments
        killed_at = kill(loop, trial, rng)
        loop.finish_segment(trial, killed_at)
        trial.seconds = time.monotonic() - started
        loop.segment_s.append(trial.seconds)
        if killed_at is None:  # no kill landed: the segment counts for the run, not as a trial
            log(f"  {fault}: segment {loop.segments} had no kill ({trial.landed}); again")
            carried = [f"segment {loop.segments}: {p}" for p in trial.problems]
            continue
        carried = []
        results.append(trial)
        log(
            f"  {fault} #{trial.trial}: {trial.seconds:.0f}s, {trial.landed}, committed {trial.committed}, lost {trial.lost}, "
            f"twice {trial.twice}, torn {trial.torn}, uncommitted {trial.uncommitted}{', ' + '; '.join(trial.problems) if trial.problems else ''}"
        )
    return results

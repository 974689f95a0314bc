"""One run's loop under trials: its parts, its segments, and what is checked after each.

Trial i is a segment of the run: rollout flows commit `steps_per_trial * groups_per_step` groups,
exactly (flows that lost groups to a kill or an unreachable server are topped up by new ones), the
trainer trains them in `steps_per_trial` steps and publishes each, the watcher reloads the server.
After the segment: every committed group trained by exactly one step, no torn file, the server not
paused and serving the version it announces, which is the newest. When every trial is done, a
fresh trainer replays the run's shards without interruption (`Loop.replay`): each step must take
the same groups and publish the same weights.
"""

from __future__ import annotations

import ast
import asyncio
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clotho.shortfall import SHORTFALL_EXIT
from soak import checks, graded
from soak.graded import JudgeServer
from soak.groups import planned_scores, read_journal
from soak.parts import Part, PolicyPart, PrefectPart, part_environment, rollout_part, trainer_part, watcher_part
from storage.checkpoints import published_steps
from storage.filesystem import list_files, resolve
from storage.layout import ROLLOUTS, SHARD_SUFFIX, join, split_run_url


@dataclass(frozen=True)
class Settings:
    groups_per_step: int = 4
    steps_per_trial: int = 3
    group_size: int = 4
    lanes: int = 2
    delay_s: float = 0.5  # per group: the segment's sampling spans a few seconds
    sample_tokens: int = 0  # > 0: completions sampled from the server (the vLLM fault)
    shard_max_age_s: float = 2.0  # the flush window
    # Rollout kills land from a flow's first finished group to this long past its last (its exit
    # flush; negative: before its last group), or, this share of the time, anywhere in its life.
    rollout_kill_tail_s: float = 2.0
    rollout_anywhere: float = 0.25
    watcher_poll_s: float = 0.5
    reload_step_timeout_s: float = 120.0  # the watcher's (clotho watch --reload-step-timeout-s)
    lr: float = 1e-3
    segment_timeout_s: float = 600.0
    serve_timeout_s: float = 240.0  # a restarted vLLM (a minute or two) plus the watcher's backoff (up to 60 s)
    grader: str = ""  # "sandbox" or "judge": groups scored by a real grader (soak.graded)
    judge_timeout_s: float = 1.0  # llm_judge's, against the soak's judge

    @property
    def groups_per_trial(self) -> int:
        return self.groups_per_step * self.steps_per_trial

    def trainer_settings(self) -> dict[str, object]:
        # No staleness bound: every committed group must be trained, so the counts are exact.
        # Every step kept (keep_last null): the replay compares each step's weights with the run's.
        return {
            "groups_per_step": self.groups_per_step,
            "save_every": 1,
            "max_lag": 10**6,
            "lr": self.lr,
            "keep_last": None,
        }


@dataclass
class Trial:
    fault: str
    trial: int
    segment: int = 0  # the loop's segment the trial ran in: its steps are trial_steps(segment)
    seconds: float = 0.0
    landed: str = ""  # where the kill landed
    committed: int = 0  # groups this trial committed
    lost: int = 0
    twice: int = 0
    torn: int = 0
    problems: list[str] = field(default_factory=list)
    uncommitted: int | None = None  # finished groups the killed flow never committed
    uncommitted_oldest_s: float | None = None  # the oldest of them at the kill
    caught_up_s: float | None = None  # from the kill until the server announced the segment's last step
    misscored: int = 0  # stored scores other than planned: a machinery failure scored as a reward shows here
    infra_failed: int = 0  # groups the flows failed as `infra` (their summaries)
    infra_retries: int = 0  # retries of a sandbox run or a judge call (the flows' logs)
    weights_equal: bool | None = None  # filled in by the replay

    @property
    def ok(self) -> bool:
        return (
            not (self.lost or self.twice or self.torn or self.misscored or self.problems)
            and self.weights_equal is not False
        )


class Loop:
    """A run's loop for one fault's trials: trainer and watcher (optional) of the run, rollout flows
    started per segment, the shared policy and Prefect servers."""

    def __init__(
        self,
        work: Path,
        model: Path,
        server_url: str,
        *,
        settings: Settings,
        prefect: PrefectPart | None = None,
        prefect_api_url: str | None = None,
        prefect_home: Path | None = None,
        policy: PolicyPart | None = None,
        watch: bool = True,
        seed: int = 0,
        storage: str | None = None,
    ):
        """`storage`: the root URL the run is written to (e.g. s3://bucket/soak, with the store's
        credentials and endpoint in the environment); by default a directory in `work`."""
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        self.work, self.model, self.server_url, self.settings = work, model, server_url, settings
        self.prefect, self.policy = prefect, policy
        api_url = prefect.api_url if prefect else prefect_api_url
        self.env = part_environment(api_url, prefect.home if prefect else prefect_home)
        # The parts' temporary files where what a kill leaves behind can be counted.
        self.env["TMPDIR"] = str(work / "tmp")
        (work / "tmp").mkdir()
        # On a shared store each loop's run has a name of its own.
        self.run_url = (
            f"file://{work}/store/run"
            if storage is None
            else f"{storage.rstrip('/')}/{work.name}-{uuid.uuid4().hex[:8]}"
        )
        self.root, self.run = split_run_url(self.run_url)
        self.trainer_dir = work / "trainer"  # the trainer's resume state, metrics and staged checkpoints
        self.staging_dir = self.trainer_dir / "staging"
        self.trainer = trainer_part(
            self.run_url, model, 10**6, settings.trainer_settings(), work, self.env, work_dir=self.trainer_dir
        )
        self.watcher = (
            watcher_part(
                self.run_url, server_url, model, work, self.env, settings.watcher_poll_s, settings.reload_step_timeout_s
            )
            if watch
            else None
        )
        self.rollouts: list[Part] = []
        self.judge = JudgeServer() if settings.grader == "judge" else None
        self.infra = {"failed": 0, "retries": 0}  # summed over the flows that ran to their end
        self.next_seed = seed * 10_000
        self.segments = 0
        self.guard = None
        # (first group, last group, exit) seconds after start, of rollout flows that ran to their end
        self.rollout_timing: list[tuple[float, float, float]] = []
        self.segment_s: list[float] = []
        # What the last count found, so that each trial reports only what went wrong in it.
        self.seen: dict = {
            "committed": 0,
            "lost": set(),
            "twice": set(),
            "torn": set(),
            "wrong": set(),
            "misscored": set(),
            "failed": 0,
            "retries": 0,
        }

    # ---- parts ---------------------------------------------------------------------------
    def start(self) -> None:
        self.trainer.start()
        if self.watcher is not None:
            self.watcher.start()
            # The shared server may still serve another fault's run: the new watcher restores it to
            # the base model (version 0) first, or this run's first groups would carry that version.
            asyncio.run(wait_version(self.server_url, 0, exact=True, timeout_s=300))

    def stop(self) -> None:
        for part in [*self.rollouts, self.trainer, *([self.watcher] if self.watcher else [])]:
            part.stop()
        if self.judge is not None:
            self.judge.stop()

    def start_rollout(self, groups: int) -> Part:
        self.next_seed += 1
        s = self.settings
        part = rollout_part(
            self.run_url,
            self.server_url,
            self.model,
            groups,
            self.next_seed,
            self.work,
            self.env,
            group_size=s.group_size,
            delay_s=s.delay_s,
            sample_tokens=s.sample_tokens,
            lanes=s.lanes,
            shard_max_age_s=s.shard_max_age_s,
            grader=s.grader,
            judge_url=self.judge.url if self.judge else "",
            judge_timeout_s=s.judge_timeout_s,
        ).start()
        self.rollouts.append(part)
        return part

    # ---- segments ------------------------------------------------------------------------
    def goal(self) -> int:
        """Groups committed at the end of the current segment."""
        return self.segments * self.settings.groups_per_trial

    def last_step(self) -> int:
        return self.segments * self.settings.steps_per_trial

    def begin_segment(self) -> int:
        self.segments += 1
        return self.goal()

    def committed(self) -> int:
        return len(checks.read_storage(self.run_url).groups)

    def shard_count(self) -> int:
        """Shards under rollouts/ (a listing, no reads: cheap enough to poll)."""
        fs, rollouts = resolve(join(self.run_url, ROLLOUTS))
        return sum(1 for path in list_files(fs, rollouts) if path.endswith(SHARD_SUFFIX))

    def fill(self, problems: list[str]) -> None:
        """Wait for the running rollout flows, then top up with new ones until the segment's
        groups are committed exactly."""
        deadline = time.monotonic() + self.settings.segment_timeout_s
        failures = 0
        while True:
            for part in [p for p in self.rollouts if not p.killed]:
                code = part.wait(max(1.0, deadline - time.monotonic()))
                if code is None:
                    part.kill()
                    problems.append(f"rollout flow {part.seed} hung: killed after the segment's timeout")
                elif code not in (0, SHORTFALL_EXIT):  # a shortfall is the flow saying it made less: topped up
                    problems.append(f"rollout flow {part.seed} exited {code}")
                    failures += 1
                else:
                    self.learn_timing(part)
                    self.count_infra(part)
            self.rollouts = []
            have = self.committed()
            if have == self.goal():
                return
            if have > self.goal():
                raise RuntimeError(
                    f"{have} groups committed, {self.goal()} asked for: a flow committed more than --groups"
                )
            if time.monotonic() > deadline or failures > 5:
                last = part.log_tail() if failures else ""
                raise TimeoutError(
                    f"segment {self.segments}: {have} of {self.goal()} groups committed, {failures} flows failed:\n{last}"
                )
            if failures:
                time.sleep(2.0)
            self.start_rollout(self.goal() - have)

    def learn_timing(self, part: Part) -> None:
        """A flow that ran to its end: when it finished its first and last group, and exited."""
        finished = sorted(read_journal(part.journal).values())
        if finished:
            self.rollout_timing.append(
                (finished[0] - part.started_wall, finished[-1] - part.started_wall, time.monotonic() - part.started_at)
            )

    def count_infra(self, part: Part) -> None:
        """The groups a flow failed as `infra` (its closing summary) and the retries it logged."""
        text = part.log_since_start()
        summary = re.findall(r"^done: (\{.*\})$", text, re.MULTILINE)
        if summary:
            self.infra["failed"] += ast.literal_eval(summary[-1])["failures_by_reason"].get("infra", 0)
        self.infra["retries"] += len(re.findall(r"(?:InfraError|JudgeError): .*; try \d+ failed, next in", text))

    def rollout_kill_moment(self, part: Part, rng) -> float:
        """When to kill a rollout flow just started: mostly while it samples and flushes (from its
        first finished group to `rollout_kill_tail_s` past its last, or its exit, as the quickest
        flow so far took), else (`rollout_anywhere` of the time) anywhere in its life. The first
        flow of a loop runs to its end (never: infinity) to show how long flows take."""
        if not self.rollout_timing:
            return float("inf")
        first, last, life = min(self.rollout_timing, key=lambda t: t[2])
        if rng.random() < self.settings.rollout_anywhere:
            return part.started_at + rng.uniform(0.0, life)
        while part.alive and not read_journal(part.journal):  # its start-up time varies with the load
            time.sleep(0.05)
        return time.monotonic() + rng.uniform(
            0.0, max(0.0, min(life, last + self.settings.rollout_kill_tail_s) - first)
        )

    def wait_trained(self, timeout_s: float | None = None) -> None:
        """Until the trainer published the segment's last step (an error if it exited meanwhile)."""
        deadline = time.monotonic() + (timeout_s or self.settings.segment_timeout_s)
        while max(published_steps(self.root, self.run), default=0) < self.last_step():
            if not self.trainer.alive:
                raise RuntimeError(f"the trainer exited {self.trainer.returncode}:\n{self.trainer.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {self.last_step()} not published in time:\n{self.trainer.log_tail()}")
            time.sleep(0.2)

    def finish_segment(self, trial: Trial, killed_at: float | None) -> None:
        """Top up, wait for training and reloads, then count what went wrong since the last count."""
        self.fill(trial.problems)
        self.wait_trained()
        if self.watcher is not None:
            try:
                asyncio.run(wait_version(self.server_url, self.last_step(), timeout_s=self.settings.serve_timeout_s))
            except TimeoutError as error:
                trial.problems.append(str(error))
            if killed_at is not None:
                trial.caught_up_s = time.time() - killed_at
            state = asyncio.run(self.server_state())
            trial.problems += state.problems(self.last_step(), self.parity_guard().tolerance)
        counted = checks.tally(self.run_url, self.last_step(), self.settings.groups_per_step, self.planned_scores)
        new = {name: getattr(counted, name) - self.seen[name] for name in ("lost", "twice", "torn")}
        trial.committed = counted.committed - self.seen["committed"]
        trial.lost, trial.twice, trial.torn = (len(new[name]) for name in ("lost", "twice", "torn"))
        trial.problems += [f"{name}: {', '.join(sorted(found)[:3])}" for name, found in new.items() if found]
        trial.problems += [problem for problem in counted.wrong_steps if problem not in self.seen["wrong"]]
        trial.misscored = len(counted.misscored - self.seen["misscored"])
        trial.problems += sorted(counted.misscored - self.seen["misscored"])[:3]
        trial.infra_failed, trial.infra_retries = (self.infra[key] - self.seen[key] for key in ("failed", "retries"))
        self.seen = {
            "committed": counted.committed,
            "lost": counted.lost,
            "twice": counted.twice,
            "torn": counted.torn,
            "wrong": set(counted.wrong_steps),
            "misscored": counted.misscored,
            **self.infra,
        }

    def planned_scores(self, item_id: str) -> list[float]:
        """The scores `item_id`'s group must carry (soak.graded.planned, soak.groups.planned_scores)."""
        size = self.settings.group_size
        if self.settings.grader:
            return [score for _, score in graded.planned(item_id, size, self.settings.grader)]
        return planned_scores(item_id, size)

    async def server_state(self) -> checks.ServerState:
        return await checks.server_state(
            self.server_url, self.run_url, self.parity_guard(), self.model, self.work / "checkpoints"
        )

    def parity_guard(self):
        if self.guard is None:
            from inference.parity_guard import ParityGuard

            self.guard = ParityGuard.for_model(self.model)
        return self.guard

    # ---- the weights ---------------------------------------------------------------------
    def replay(self, trials: list[Trial]) -> list[checks.Comparison]:
        """A fresh trainer over copies of the same shards, uninterrupted, to the last step: every
        trial's steps must take the same groups and publish the same weights."""
        replay_url = f"file://{self.work}/replay/run"
        checks.copy_shards(self.run_url, replay_url)
        steps = self.last_step()
        replaying = trainer_part(
            replay_url, self.model, steps, self.settings.trainer_settings(), self.work, self.env, name="replay"
        )
        replaying.start()
        if replaying.wait(self.settings.segment_timeout_s * 2) != 0:
            raise RuntimeError(f"the replay trainer failed:\n{replaying.log_tail()}")
        comparisons = checks.compare_runs(self.run_url, replay_url, steps)
        per_step = {c.step: c for c in comparisons}
        for trial in trials:
            mine = [per_step[s] for s in trial_steps(trial.segment, self.settings.steps_per_trial)]
            trial.weights_equal = all(c.equal and c.same_groups for c in mine)
            if not trial.weights_equal:
                worst = max(c.max_difference for c in mine)
                trial.problems.append(
                    f"replayed steps differ (groups {all(c.same_groups for c in mine)}, weights max |diff| {worst:.3g})"
                )
        return comparisons


def trial_steps(segment: int, steps_per_trial: int) -> range:
    return range((segment - 1) * steps_per_trial + 1, segment * steps_per_trial + 1)


async def wait_version(base_url: str, version: int, *, exact: bool = False, timeout_s: float) -> None:
    from inference.client import PolicyClient

    deadline = time.monotonic() + timeout_s
    async with PolicyClient(base_url, max_retries=0) as client:
        while True:
            try:
                served = await client.weight_version()
                if served == version or (not exact and served >= version):
                    return
            except Exception:  # noqa: BLE001 - down or restarting: keep asking until the deadline
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base_url} does not announce version {version} after {timeout_s:.0f}s")
            await asyncio.sleep(0.25)


def wait_until(moment: float, part_alive: Callable[[], bool] | None = None) -> bool:
    """Sleep until time.monotonic() reaches `moment`; False if `part_alive` turned False first."""
    while time.monotonic() < moment:
        if part_alive is not None and not part_alive():
            return False
        time.sleep(min(0.05, max(0.0, moment - time.monotonic())))
    return True


def estimate(observed: list[float], default: float) -> float:
    """A part's expected life: the shortest seen so far (a kill drawn inside it always lands)."""
    return min(observed) if observed else default

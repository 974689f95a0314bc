"""`clotho run` end to end: real vLLM-CPU servers started by the pipeline, hot reload, rollout
subflows with bounded staleness, the DeepSpeed trainer as a process; then Ctrl-C mid-run."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from inference.watcher import DEFAULT_CACHE, run_cache_dir
from storage.inspection import verify
from storage.reader import ShardReader
from trainer.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CLOTHO = str(Path(sys.executable).with_name("clotho"))


def write_config(tmp_path: Path, model: Path, steps: int, **fields) -> Path:
    config = {
        "run": f"file://{tmp_path}/store/run",
        "model": str(model),
        "max_lag": 1,
        "trainer": {"lr": 3e-3, "groups_per_step": 2, "save_every": 1},
        "phases": [
            {
                "name": "rl",
                "steps": steps,
                "environments": [{"env": "arithmetic", "config": {"group_size": 4, "max_tokens": 4}}],
            }
        ],
        "rollout": {"max_concurrent_groups": 2, "task_run_s": 2.0},
        "servers": {"reload_poll_s": 0.25},
        **fields,
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def marked(environment: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The environment of a command whose every process left_behind(str(tmp_path)) must find:
    children inherit the variable (the model path, shared with the session server, names no test)."""
    return {**environment, "CLOTHO_TEST_MARKER": str(tmp_path)}


def left_behind(marker: str) -> list[str]:
    """Processes whose command line or environment names this test's directory (servers, trainer,
    flows, a temporary Prefect server with its PREFECT_HOME there)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if process.pid == psutil.Process().pid:
            continue
        try:
            environment = " ".join(process.environ().values())
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            environment = ""
        if any(marker in part for part in (process.info["cmdline"] or [])) or marker in environment:
            found.append(" ".join(process.info["cmdline"] or []))
    return found


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, prefect_server, tiny_model_dir):
    """One `clotho run` for the tests below (a run costs a vLLM start and a trainer start), in
    asyncio's debug mode:
    1000 steps of RL allowed, evaluated every 2 versions, with phases[-1].stop holding at the
    phase's third evaluation (target 0; min_delta 1 makes a new best impossible; patience 2 keeps
    the run going long enough for the live card to be read a few times while it goes)."""
    tmp_path = tmp_path_factory.mktemp("stopped-run")
    model = tiny_model_dir  # read only: no copy needed; CLOTHO_TEST_MARKER (marked) finds the processes
    config = write_config(
        tmp_path,
        model,
        steps=1000,
        evaluation={"env": "arithmetic", "config": {"max_tokens": 4}, "items": 4, "every": 2},
    )
    settings = yaml.safe_load(config.read_text())
    settings["phases"][0]["stop"] = {"reward": 0.0, "patience": 2, "min_delta": 1.0}
    config.write_text(yaml.safe_dump(settings))
    started = datetime.now(UTC)
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with stdout.open("w") as out, stderr.open("w") as err:
        # asyncio's debug mode: every callback on the flow's loop longer than SLOW_CALLBACK_S is logged.
        environment = marked({**prefect_server.env(), "PYTHONASYNCIODEBUG": "1"}, tmp_path)
        process = subprocess.Popen(
            [CLOTHO, "run", str(config)], cwd=REPO, env=environment, stdout=out, stderr=err, text=True
        )
    live: list[tuple[str, str]] = []  # (artifact id, text) of the live card, as the UI reads it while the run goes
    try:
        deadline = time.monotonic() + 900
        while process.poll() is None and time.monotonic() < deadline:
            live += [(card["id"], card["data"]) for card in live_cards(prefect_server, started)]
            time.sleep(1.0)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    output = stdout.read_text() + stderr.read_text()
    assert process.returncode == 0, output[-5000:]
    summary = json.loads(stdout.read_text()[stdout.read_text().index("{") :])
    return StoppedRun(tmp_path, output, summary, started, live, live_cards(prefect_server, started))


@dataclasses.dataclass
class StoppedRun:
    tmp_path: Path
    output: str
    summary: dict
    started: datetime
    live: list[tuple[str, str]]  # the live card's (artifact id, text) read while the run went
    after: list[dict]  # the live card(s) read after it ended


def live_cards(prefect_server, since: datetime) -> list[dict]:
    """The run's live card(s) through Prefect's API: artifacts under pipeline-run-live made since
    `since` (this worker's Prefect server runs one pipeline at a time)."""
    body = {"artifacts": {"key": {"any_": ["pipeline-run-live"]}}, "sort": "CREATED_DESC"}
    cards = httpx.post(f"{prefect_server.api_url}/artifacts/filter", json=body, timeout=30).json()
    return [card for card in cards if datetime.fromisoformat(card["created"].replace("Z", "+00:00")) >= since]


def test_nothing_blocks_the_pipelines_event_loop(stopped_run):
    """The run's servers, reload watcher, evaluator, rollout flows, trainer and stop rule share the
    flow's event loop: every storage call, process wait and sleep runs in a thread or awaits, so in
    debug mode asyncio logs no callback of ours longer than SLOW_CALLBACK_S (0.25 s)."""
    from clotho.flow_runtime import SLOW_CALLBACK_S

    slow = [line for line in stopped_run.output.splitlines() if "Executing <" in line and " took " in line]
    ours = [line for line in slow if re.search(rf"{re.escape(str(REPO))}/(?!\.venv)", line)]
    assert SLOW_CALLBACK_S == 0.25 and ours == [], "\n".join(ours)


def test_a_short_pipeline_trains_reloads_and_stops_clean(stopped_run, prefect_server):
    tmp_path, output, summary = stopped_run.tmp_path, stopped_run.output, stopped_run.summary
    steps = summary["steps"]
    stopped_at = summary["stopped_by_rule"]["version"]  # the phase's third evaluation: 6 or later
    assert 6 <= stopped_at <= steps < 30 and 0 < summary["utilization"] <= 1, summary

    root = tmp_path / "store"
    checkpoints = sorted(p.name for p in (root / "run" / "checkpoints").iterdir() if p.name.startswith("step-"))
    # Retention's default (keep_last 3): the last three steps and the best evaluated one, all STABLE.
    kept = {f"step-{step:08d}" for step in (steps - 2, steps - 1, steps, summary["best"]["step"])}
    assert set(checkpoints) == kept and all(
        (root / "run" / "checkpoints" / s / "STABLE").exists() for s in checkpoints
    ), checkpoints
    assert summary["storage"]["checkpoints"] == len(kept) and summary["storage"]["shard_bytes"] > 0
    groups = list(ShardReader(f"file://{root}", "run").groups())
    versions = [g.policy_version for g in groups]
    assert max(versions) >= 2, f"the servers never served a new checkpoint: {versions}"  # reloaded
    history = read_metrics(root / "run" / "trainer")
    assert [row["step"] for row in history] == list(range(1, steps + 1))
    assert all(row["staleness_max"] <= 1 for row in history), "a group older than k = 1 was trained"
    assert all("utilization" in row and "idle_fraction" in row for row in history)
    assert all(not check.problems for check in verify(f"file://{root}/run"))
    assert f"evaluation at version {stopped_at}" in output
    assert left_behind(str(tmp_path)) == []
    # The watcher's copies (delta steps rebuilt, reload dirs) go with the run; the checkpoints stay in storage.
    assert not run_cache_dir(f"file://{root}/run", REPO / DEFAULT_CACHE).exists()

    # What the pipeline measures itself: each reload's time (JSONL, TensorBoard, the table), the
    # staleness histogram and sample utilization (groups trained / groups the samplers committed).
    events = [json.loads(line) for line in (root / "run" / "trainer" / "pipeline.jsonl").read_text().splitlines()]
    reloads = {e["version"]: e["reload_s"] for e in events if e["event"] == "reload"}
    assert len(reloads) >= 2 and all(0 < seconds < 60 for seconds in reloads.values()), reloads
    assert summary["reloads"] == len(reloads) and summary["reload_s_max"] == max(reloads.values())
    assert [e["phase"] for e in events if e["event"] == "phase"] == ["rl"]
    assert [e["step"] for e in events if e["event"] == "evaluation"][-1] == stopped_at
    assert (
        0 < summary["sample_utilization"] <= 1 and summary["groups_trained"] == 2 * steps <= summary["groups_sampled"]
    )
    assert (
        set(summary["staleness_histogram"]) <= {"0", "1"} and sum(summary["staleness_histogram"].values()) == 2 * steps
    )
    staleness = prefect_server.cli("artifact", "inspect", "pipeline-run-staleness").stdout
    assert "versions_behind" in staleness, staleness
    # The best evaluated checkpoint is marked (BEST: the first of the highest held-out rewards after
    # version 0), still there, and named by the stop line and the summary.
    curve = {e["step"]: e["reward"] for e in events if e["event"] == "evaluation" and e["step"] > 0}
    best = summary["best"]
    assert best["reward"] == max(curve.values()) and best["step"] == min(
        s for s, r in curve.items() if r == best["reward"]
    )
    assert json.loads((root / "run" / "checkpoints" / "BEST").read_text())["step"] == best["step"]
    assert (root / "run" / "checkpoints" / f"step-{best['step']:08d}" / "STABLE").exists()
    assert f"stopping (best: step {best['step']} (held-out {best['reward']:.3f}))" in output


def test_a_run_ends_when_its_stop_rule_holds_on_the_held_out_curve(stopped_run):
    """phases[-1].stop: the run ends on the evaluation curve, not its step count."""
    output, summary = stopped_run.output, stopped_run.summary
    evaluated = [int(v) for v in re.findall(r"evaluation at version (\d+) \(rl\)", output)]
    first, second, third = [v for v in evaluated if v > 0]  # version 0 is the start, not the phase's
    assert 2 <= first and first + 2 <= second and second + 2 <= third, evaluated  # `every: 2` versions, as served
    assert summary["stopped_by_rule"]["version"] == evaluated[-1] and "no new best in 2 evaluations" in output
    # An end by the rule is a normal end: the rollout flows end on their own, nothing crashed.
    assert "Crash detected" not in output and "Crashed" not in output, output[-5000:]
    assert "rollout finished" in output, output[-5000:]


def test_the_live_card_shows_the_run_while_it_goes_and_is_one_card(stopped_run):
    """What the Prefect UI showed during the run (read through the API while `clotho run` ran), not
    only at its end: the reward chart, the latest steps and the served version, on one artifact."""
    summary, live, after = stopped_run.summary, stopped_run.live, stopped_run.after
    during = [text for _, text in live if "`: running" in text and re.search(r"step \*\*([2-9]|\d\d+)\*\*", text)]
    assert during, [text[:200] for _, text in live]
    text = during[-1]
    assert "## Reward over steps" in text and "· training reward (sampled)" in text
    chart = text.split("```text\n", 1)[1].split("```", 1)[0]
    assert chart.count("·") > 1, chart  # the training reward of the steps so far, plotted
    assert re.search(r"servers serve policy \*\*v\d+\*\* \(reloaded in [\d.]+ s\)", text), text
    rows = text.split("newest first\n\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    steps = [int(row.split(" | ")[0].strip("| ")) for row in rows]
    assert steps == sorted(steps, reverse=True) and steps[0] >= 2, rows
    # What the model writes: a few completions of the newest stored group, with their scores.
    assert any("## Latest sampled completions (the newest group stored)" in text for _, text in live)
    # The run's summary, stored beside its metrics, keeps the first and the last ones (printed too).
    stored = json.loads((stopped_run.tmp_path / "store" / "run" / "trainer" / "summary.json").read_text())
    first, last = stored["completions"]["first"], stored["completions"]["last"]
    assert first and last and {row["env"] for row in first + last} == {"arithmetic"}
    assert stored["steps"] == summary["steps"] and "completions" not in summary  # stdout: the JSON, shorter
    assert "sampled completions, the last group stored" in stopped_run.output
    # One card, replaced in place: the same artifact during and after, saying the run finished.
    assert len({artifact_id for artifact_id, _ in live}) == 1 and [card["id"] for card in after] == [live[0][0]]
    assert after[0]["data"].startswith("# Run `run`: finished") and f"step **{summary['steps']}**" in after[0]["data"]


def test_the_run_s_page_has_its_effective_config_and_its_reloads_evaluations_and_phases_as_events(
    stopped_run, prefect_server
):
    config = httpx.post(
        f"{prefect_server.api_url}/artifacts/filter",
        json={"artifacts": {"key": {"any_": ["pipeline-run-config"]}}, "sort": "CREATED_DESC"},
        timeout=30,
    ).json()
    text = config[0]["data"]
    assert (
        "with `--set" not in text and "max_lag: 1" in text and "groups_per_step: 2" in text and "patience: 2" in text
    ), text
    body = {
        "filter": {
            "event": {"prefix": ["clotho.pipeline."]},
            "resource": {"id": ["clotho.run.run"]},
            "occurred": {"since": stopped_run.started.isoformat()},
        },
        "limit": 50,
    }
    deadline, kinds = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # the server stores events in batches
        response = httpx.post(f"{prefect_server.api_url}/events/filter", json=body, timeout=30)
        assert response.status_code == 200, response.text
        events = response.json()["events"]
        kinds = {
            kind: [e["payload"] for e in events if e["event"] == f"clotho.pipeline.{kind}"]
            for kind in ("phase", "reload", "evaluation")
        }
        if (
            all(kinds.values())
            and len(kinds["reload"]) >= stopped_run.summary["reloads"]
            and len(kinds["evaluation"]) >= 3
        ):
            break  # every reload stored (the last ones may land a batch later than the evaluations)
        time.sleep(2)
    assert [p["phase"] for p in kinds["phase"]] == ["rl"], kinds
    assert len(kinds["reload"]) == stopped_run.summary["reloads"], kinds["reload"]
    assert sorted(p["step"] for p in kinds["evaluation"])[-1] == stopped_run.summary["stopped_by_rule"]["version"], (
        kinds
    )


def own_run_after_steps(tmp_path: Path, model: Path, steps: int) -> tuple[subprocess.Popen, Path]:
    """A `clotho run` as a user starts one in a terminal (its own temporary Prefect server, a session
    of its own, marked), once its trainer has taken `steps` steps; and its metrics directory."""
    config = write_config(tmp_path, model, steps=1000)
    environment = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    environment["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    process = subprocess.Popen(
        [CLOTHO, "run", str(config)],
        cwd=REPO,
        env=marked(environment, tmp_path),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "store" / "run" / "trainer"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and len(read_metrics(metrics)) < steps:
        if process.poll() is not None:
            raise AssertionError(process.stdout.read()[-5000:])
        time.sleep(1)
    if len(read_metrics(metrics)) < steps:
        process.kill()
        raise AssertionError("the pipeline never got going")
    return process, metrics


def test_ctrl_c_stops_every_part_and_loses_no_committed_group(tmp_path, tiny_model_dir):
    """As in a terminal: the temporary local Prefect server, and Ctrl-C sent to the whole process
    group (which must not take that server down in the middle of the pipeline's cleanup)."""
    model = tiny_model_dir  # read only: no copy needed; CLOTHO_TEST_MARKER (marked) finds the processes
    process, metrics = own_run_after_steps(tmp_path, model, 3)
    try:
        assert any("trainer.cli" in line for line in left_behind(str(tmp_path)))
        os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the group
        output, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output[-5000:]
    assert "Error logging to API" not in output and "Unable to connect" not in output, output[-5000:]
    assert left_behind(str(tmp_path)) == [], "a process outlived the pipeline"
    # Every shard that was committed is whole and readable; the trainer resumes from its state.
    assert all(not check.problems for check in verify(f"file://{tmp_path}/store/run"))
    assert (metrics / "state").exists()


def test_a_sigkill_of_the_command_leaves_none_of_its_processes(tmp_path, tiny_model_dir):
    """As the OOM killer or a CI timeout ends it: SIGKILL to the `clotho run` process alone. Its
    Prefect server, policy server (with vLLM's engine) and trainer end within the tether's bound
    (core/tether.py: POLL_S + GRACE_S)."""
    from core import tether

    process, _ = own_run_after_steps(tmp_path, tiny_model_dir, 2)
    try:
        running = left_behind(str(tmp_path))
        assert any("trainer.cli" in line for line in running) and any("vllm" in line for line in running), running
        assert any("prefect" in line and "server" in line for line in running), running
        process.kill()
        process.wait(10)
        killed = time.monotonic()
        bound = tether.POLL_S + tether.GRACE_S + 5.0  # + the time to see them gone on two loaded cores
        while time.monotonic() - killed < bound and left_behind(str(tmp_path)):
            time.sleep(0.5)
        assert left_behind(str(tmp_path)) == [], f"alive {bound:.0f} s after the command's SIGKILL"
    finally:
        process.kill()
        for child in psutil.process_iter():  # never leave them to the next test
            with contextlib.suppress(psutil.Error):
                if str(tmp_path) in " ".join(child.environ().values()) and child.pid != os.getpid():
                    child.kill()


def test_two_workers_on_the_rollout_pool_both_take_rollout_flows_of_one_pipeline(
    tmp_path, prefect_server, tiny_model_dir
):
    """rollout.deployment: the pipeline starts its rollout flows as runs of the rollout deployment;
    two `prefect worker` processes on the pool (one flow run at a time each) take one each."""
    import contextlib

    prefect_server.cli("work-pool", "create", "rollout-pool", "--type", "process", "--overwrite")
    prefect_server.cli("--no-prompt", "deploy", "--name", "rollout-pipeline", cwd=REPO)
    model = tiny_model_dir  # read only: no copy needed; CLOTHO_TEST_MARKER (marked) finds the processes
    config = write_config(
        tmp_path,
        model,
        steps=8,
        rollout={"flows": 2, "deployment": "rollout/rollout-pipeline", "max_concurrent_groups": 2},
    )
    logs = [tmp_path / f"worker-{name}.log" for name in ("a", "b")]
    workers = [
        subprocess.Popen(
            [
                str(Path(sys.executable).with_name("prefect")),
                "worker",
                "start",
                "--pool",
                "rollout-pool",
                "--name",
                log.stem,
                "--limit",
                "1",
            ],
            env={**prefect_server.env(), "PREFECT_WORKER_QUERY_SECONDS": "2"},
            cwd=REPO,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for log in logs
    ]
    try:
        done = subprocess.run(
            [CLOTHO, "run", str(config)],
            cwd=REPO,
            env=marked(prefect_server.env(), tmp_path),
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(60)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    # Both workers may start submitting the same flow run; the server lets one have it and the other
    # logs an aborted submission. What each worker ran: its submissions less its aborted ones.
    ran = []
    for log in logs:
        text = log.read_text().lower()
        submitted = set(re.findall(r"submitting flow run '([0-9a-f-]+)'", text))
        ran.append(submitted - set(re.findall(r"aborted submission of flow run '([0-9a-f-]+)'", text)))
    assert [len(runs) for runs in ran] == [1, 1] and ran[0] != ran[1], (ran, [log.read_text()[-2000:] for log in logs])
    # Each flow committed groups, in a sampler slot of its own (both ran at once: neither slot was free).
    slots = [json.loads(p.read_text()) for p in (tmp_path / "store" / "run" / "progress" / "samplers").glob("*.json")]
    committed = {slot["holder"]: slot["committed"] for slot in slots}
    assert len(committed) == 2 and all(count > 0 for count in committed.values()), committed
    assert len(read_metrics(tmp_path / "store" / "run" / "trainer")) == 8

"""The pipeline's live card: its text for a run in progress, and the artifact updated in place on a
real Prefect server (one artifact under the run's key, its data replaced)."""

from __future__ import annotations

import asyncio

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.artifacts import Card
from flows.live_view import live_markdown, rounded, text_chart
from inference.watcher import ReloadOutcome


def step_rows(count: int) -> list[dict]:
    return [
        {
            "step": s,
            "time": 1000.0 + 2 * s,
            "score_mean": s / count,
            "loss": 0.123456789 * s,
            "policy_version": s - 1,
            "staleness_max": 1,
            "groups_per_s": 1.98765,
            "tokens": 3000 + s,
            "step_time_s": 0.812345,
        }
        for s in range(1, count + 1)
    ]


def test_numbers_are_rounded_and_missing_ones_are_a_dash() -> None:
    assert [rounded(v) for v in (0.123456789, 3.0, 12, None, float("nan"), 1234.5678)] == [
        "0.1235",
        "3",
        "12",
        "–",
        "–",
        "1235",
    ]


def test_the_chart_puts_the_lowest_and_highest_points_in_its_corners() -> None:
    chart = text_chart(
        {"trained": ("·", [(1, 0.0), (50, 0.5), (100, 1.0)]), "held out": ("o", [(100, 1.0)])}, width=20, height=5
    )
    lines = chart.splitlines()
    assert lines[0].startswith("1.00 ┤") and lines[0].endswith("o")  # held out drawn over trained at (100, 1.0)
    assert lines[4].startswith("0.00 ┤·")
    assert "step 1" in lines[6] and lines[6].endswith("step 100")
    assert "· trained" in lines[7] and "o held out" in lines[7]
    assert text_chart({"trained": ("·", [])}) == "(no values yet)"


def test_the_card_says_where_the_run_is_and_shows_the_latest_steps_newest_first() -> None:
    steps = step_rows(24)
    curve = [
        {"phase": "rl", "step": 0, "reward": 0.25, "minutes": 0.1},
        {"phase": "rl", "step": 20, "reward": 0.75, "minutes": 1.4},
    ]
    text = live_markdown(
        "demo", "rl", 100, steps, curve, {19: 0.061, 23: 0.0712}, 95.0, {"0": 6.0, "1": 42.0}, seconds_per_step=2.0
    )
    assert text.startswith("# Run `demo`: running")
    assert "step **24** of 100 (24%)" in text and "1.6 min elapsed" in text
    assert "~2.5 min left at 2.00 s a step" in text  # 76 steps left at 2 s each
    assert "servers serve policy **v23** (reloaded in 0.07 s)" in text and "1.99 groups/s trained" in text
    assert "0 behind 12%, 1 behind 88%" in text
    table = text[text.index("## Latest 10 steps") :].split("\n\n", 2)[1].splitlines()
    assert table[0] == "| step | reward | loss | policy | staleness max | groups/s | tokens | step s |"
    assert [row.split(" | ")[0] for row in table[2:]] == [f"| {s}" for s in range(24, 14, -1)]
    assert table[2] == "| 24 | 1 | 2.963 | 23 | 1 | 1.988 | 3024 | 0.8123 |"
    loss_chart = text[text.index("## Loss over steps") :].split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    assert loss_chart[0].startswith("2.96 ┤") and loss_chart[0].endswith("·") and "· loss" in loss_chart[-1], loss_chart
    assert "failures by reason per environment, as groups land: artifact `rollout-env-stats-demo`" in text
    evaluations = text[text.index("## Held-out evaluations") :].splitlines()
    assert evaluations[4:6] == ["| 20 | rl | 0.75 | 1.4 |", "| 0 | rl | 0.25 | 0.1 |"]
    done = live_markdown("demo", "rl", 100, steps, curve, {}, 95.0, {}, finished=True)
    assert done.startswith("# Run `demo`: finished") and "min left" not in done and "best checkpoint" not in done
    best = {"step": 20, "reward": 0.75, "checkpoint": "file:///s/demo/checkpoints/step-00000020"}
    marked = live_markdown("demo", "rl", 100, steps, curve, {}, 95.0, {}, finished=True, best=best)
    assert "best checkpoint **step 20** (held-out 0.750, kept as checkpoints/BEST)" in marked


@pytest.mark.integration
def test_the_card_is_one_artifact_updated_in_place_at_most_every_interval(prefect_server) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    key = "pipeline-live-card-test"

    async def stored() -> list:
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    async def scenario():
        card = Card("markdown", key, "a test card", interval_s=3600.0)
        await card.show("step 1")
        await card.show("step 2")  # within the interval: not sent
        built: list[str] = []
        await card.show(lambda: built.append("step 2b") or "step 2b")  # nor built
        throttled = [a.data for a in await stored()]
        await card.show(lambda: built.append("step 3") or "step 3", force=True)  # the run's end
        return card.artifact_id, throttled + built, await stored()

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        artifact_id, throttled, artifacts = asyncio.run(scenario())
    assert throttled == ["step 1", "step 3"]  # stored before the end: step 1; built: only the end's content
    assert [(a.id, a.type, a.data) for a in artifacts] == [
        (artifact_id, "markdown", "step 3")
    ]  # one artifact, replaced in place


def test_the_card_shows_a_new_served_version_at_once_and_otherwise_waits_its_interval(tmp_path) -> None:
    """A reload is what a person watching waits for: the card does not hold it back for the
    interval (a short run could end before the next update and never show it while it went)."""
    from flows.live_view import RunView
    from flows.pipeline_config import PipelineConfig

    config = PipelineConfig.model_validate(
        {
            "run": f"file://{tmp_path}/run",
            "model": "m",
            "phases": [{"name": "rl", "steps": 10, "environments": [{"env": "arithmetic"}]}],
        }
    )
    view = RunView(config, "run", tmp_path / "work")
    sent: list[bool] = []

    async def show(content, force: bool = False) -> None:
        sent.append(force)
        if force or not sent[:-1]:
            content()  # what Card.show builds when it sends

    view.live.show = show
    outcome = ReloadOutcome("u", 1, "reloaded", "", swap_s=0.1, parity_s=0.1, total_s=0.2, fetch_s=0.0)

    async def scenario() -> None:
        await view.show_live()  # the first card: nothing served yet
        await view.show_live()
        await view.measured.reloads([outcome])
        await view.show_live()  # v1 served: at once
        await view.show_live()  # nothing new: the interval decides
        await view.show_live(finished=True)

    asyncio.run(scenario())
    assert sent == [False, False, True, False, True]

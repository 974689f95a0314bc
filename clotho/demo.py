"""`make demo`: the pipeline of runs/demo.yaml on two CPU cores, from nothing to a learning curve.

Builds the small demo model (random weights, offline), then `clotho run runs/demo.yaml`: an SFT
warm start on a few demonstrations through the same pipe as rollouts, then RL on the task, both
measured the same way (greedy answers to held-out items). Ends with the curve as a table, as
`.clotho/demo/summary.json` and as `.clotho/demo/reward-curve.png`.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "runs" / "demo.yaml"
COLORS = {"sft": (52, 101, 164), "rl": (204, 0, 0)}


def run_demo(workdir: Path, run_flow, overrides: list[str] | None = None) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from flows.pipeline import pipeline
    from inference.tiny_model import build_tiny_model

    console = Console()
    workdir = workdir.resolve()
    model = workdir / "model"
    if not (model / "clotho_model.json").exists() or json.loads((model / "clotho_model.json").read_text()).get("size") != "small":
        console.print(f"building the small demo model in {model}")
        shutil.rmtree(model, ignore_errors=True)
        build_tiny_model(model, seed=0, size="small")
    storage = workdir / "storage"
    if (storage / "demo").exists():  # every demo starts from policy version 0
        console.print(f"removing the previous demo run {storage / 'demo'}")
        shutil.rmtree(storage / "demo")
    started = time.monotonic()
    settings = [f"model={json.dumps(str(model))}", f"run={json.dumps(str(storage / 'demo'))}", *(overrides or [])]
    summary = run_flow(pipeline(config_path=str(DEMO_CONFIG), overrides=settings))
    curve = summary.get("curve", [])
    verdict = learning_verdict(curve)
    (workdir / "summary.json").write_text(json.dumps({**summary, "verdict": verdict}, indent=1))
    draw_curve(curve, workdir / "reward-curve.png")

    table = Table(title=f"clotho demo: {summary['steps']} steps in {(time.monotonic() - started) / 60:.1f} min")
    for column in ("phase", "step", "reward (greedy, held out)", "minutes"):
        table.add_column(column)
    for row in curve:
        table.add_row(row["phase"], str(row["step"]), f"{row['reward']:.3f}", f"{row['minutes']:.1f}")
    console.print(table)
    console.print(verdict["line"])
    console.print(f"summary: {workdir / 'summary.json'}  curve: {workdir / 'reward-curve.png'}")
    return {**summary, "verdict": verdict}


def learning_verdict(curve: list[dict[str, Any]], minutes: float = 15.0) -> dict[str, Any]:
    """Start, the SFT phase's plateau (its best), the end (the last evaluation), what RL added
    to the plateau, and whether the demo's criterion holds: the end >= 0.8 or 0.5 above the start,
    the RL phase +0.2 over the plateau, within `minutes`."""
    if not curve:
        return {"line": "no evaluation ran"}
    sft = [row["reward"] for row in curve if row["phase"] == "sft"]
    start, end = curve[0]["reward"], curve[-1]["reward"]
    plateau = max(sft) if sft else start
    gain = end - plateau
    met = (end >= 0.8 or end - start >= 0.5) and gain >= 0.2 and curve[-1]["minutes"] <= minutes
    line = (
        f"reward {start:.2f} at the start, {plateau:.2f} after the SFT warm start, {end:.2f} at the end "
        f"(RL added {gain:+.2f}) in {curve[-1]['minutes']:.1f} minutes: "
        + ("learned (>= 0.8 or +0.5, and RL +0.2 over SFT, within 15 minutes)" if met else "the learning criterion is not met")
    )
    return {"start": start, "sft_plateau": plateau, "end": end, "rl_gain": gain, "criterion_met": met, "line": line}


def draw_curve(curve: list[dict[str, Any]], path: Path, size: tuple[int, int] = (720, 400)) -> None:
    """The curve as a PNG: reward (0-1) over steps, one color per phase."""
    from PIL import Image, ImageDraw

    width, height = size
    left, right, top, bottom = 60, 20, 30, 50
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    last_step = max((row["step"] for row in curve), default=1) or 1

    def point(step: float, reward: float) -> tuple[float, float]:
        return (left + (width - left - right) * step / last_step, top + (height - top - bottom) * (1.0 - reward))

    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = point(0, tick)[1]
        draw.line([(left, y), (width - right, y)], fill=(225, 225, 225))
        draw.text((10, y - 6), f"{tick:.2f}", fill="black")
    draw.line([(left, top), (left, height - bottom), (width - right, height - bottom)], fill="black")
    draw.text((left, height - bottom + 10), "0", fill="black")
    draw.text((width - right - 30, height - bottom + 10), f"step {last_step}", fill="black")
    draw.text((left, 8), "greedy reward on held-out items", fill="black")
    for previous, row in zip(curve, curve[1:]):
        draw.line([point(previous["step"], previous["reward"]), point(row["step"], row["reward"])], fill=COLORS.get(row["phase"], "gray"), width=3)
    for row in curve:
        x, y = point(row["step"], row["reward"])
        draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=COLORS.get(row["phase"], "gray"))
    for index, (phase, color) in enumerate(COLORS.items()):
        draw.text((width - right - 80, top + 10 + 14 * index), phase, fill=color)
    image.save(path)

"""What a person watching the Prefect UI sees while `clotho demo` runs: a real `prefect server start`
(fresh home), the demo against it, and every `--every` steps a headless Chromium screenshot of the
live card and of the pipeline run's page, with what the card held then. The demo may stop on its
held-out curve before its last step, so the report names the shots nearest a third and two thirds
of the steps it ran.

    .venv/bin/python -m bench.ui_watch [--out .clotho/ui-watch] [--port 4210] [--every 20]

Writes OUT/step-40-live.png, OUT/step-40-run.png, ... and OUT/ui_watch.json (per moment: the step,
the card's facts, the screenshots). Needs chromium (or CHROMIUM=path)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from soak.parts import PrefectPart

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".clotho" / "ui-watch")
    parser.add_argument("--port", type=int, default=4210)
    parser.add_argument("--every", type=int, default=20, help="Shoot each time the run passes this many more steps.")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    args = parser.parse_args()
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("ui_watch: no chromium found; install it or set CHROMIUM=path")
    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="clotho-ui-watch-"))
    ui = f"http://127.0.0.1:{args.port}"
    server = PrefectPart(home / "prefect", args.port)  # soak's: `prefect server start`, its log in the home
    env = {**os.environ, "PREFECT_HOME": str(server.home), "PREFECT_API_URL": server.api_url, "DO_NOT_TRACK": "1"}
    demo = None
    moments: list[dict] = []
    started = datetime.now(UTC)
    try:
        server.start()
        demo = subprocess.Popen(
            [str(BIN / "clotho"), "demo"],
            cwd=REPO,
            env=env,
            stdout=(args.out / "demo.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        next_shot = args.every
        deadline = time.monotonic() + args.timeout_s
        while demo.poll() is None and time.monotonic() < deadline:
            card = live_card(f"{ui}/api", started)
            found = card and re.search(r"step \*\*(\d+)\*\* of (\d+)", card["data"])
            if found and "`: running" in card["data"] and int(found[1]) >= next_shot:
                moments.append(shoot(chromium, ui, card, int(found[1]), int(found[2]), args.out))
                print(
                    f"ui_watch: step {found[1]} of {found[2]}: {[s['png'] for s in moments[-1]['shots'].values()]}",
                    flush=True,
                )
                next_shot = int(found[1]) + args.every
            time.sleep(2.0)
    finally:
        try:
            if demo is not None and demo.poll() is None:
                demo.terminate()  # clotho demo stops its servers and flows on SIGTERM
                try:
                    demo.wait(180)
                except subprocess.TimeoutExpired:
                    demo.kill()
                    demo.wait()
        finally:
            server.stop()
            shutil.rmtree(home, ignore_errors=True)
    steps = steps_run(REPO / ".clotho" / "demo" / "summary.json", since=started.timestamp())
    nearest = {}
    if steps and moments:
        for name, fraction in (("a third", 1 / 3), ("two thirds", 2 / 3)):
            moment = min(moments, key=lambda m: abs(m["step"] - fraction * steps))
            nearest[name] = {"step": moment["step"], "of_steps_run": steps, "shots": moment["shots"]}
    report = {
        "demo_exit": demo.returncode if demo else None,
        "steps_run": steps,
        "nearest": nearest,
        "moments": moments,
    }
    (args.out / "ui_watch.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def live_card(api: str, since: datetime) -> dict | None:
    body = {"artifacts": {"key": {"any_": ["pipeline-demo-live"]}}, "sort": "CREATED_DESC", "limit": 1}
    cards = httpx.post(f"{api}/artifacts/filter", json=body, timeout=30).json()
    cards = [c for c in cards if datetime.fromisoformat(c["created"].replace("Z", "+00:00")) >= since]
    return cards[0] if cards else None


def steps_run(summary_path: Path, since: float) -> int | None:
    """The steps the demo ran (the summary it wrote after `since`; the stop rule may end it early)."""
    if not summary_path.exists() or summary_path.stat().st_mtime < since:
        return None
    summary = json.loads(summary_path.read_text())
    return summary.get("steps")


def shoot(chromium: str, ui: str, card: dict, step: int, total: int, out: Path) -> dict:
    """Screenshots of the live card's page and the pipeline run's page, and what the card said."""
    name = f"step-{step}"
    pages = {"live": f"{ui}/artifacts/artifact/{card['id']}", "run": f"{ui}/runs/flow-run/{card['flow_run_id']}"}
    shots = {}
    for kind, url in pages.items():
        path = out / f"{name}-{kind}.png"
        # The UI renders the card's markdown after its API calls; on a busy machine that can take
        # longer than the virtual time budget (a blank card was seen once): check the DOM, retry once.
        for attempt in range(2):  # noqa: B007 - the attempts taken are recorded after the loop
            rendered = chromium_run(chromium, ["--dump-dom", url]).stdout if kind == "live" else "Reward over steps"
            chromium_run(chromium, [f"--screenshot={path}", url])
            if "Reward over steps" in rendered:
                break
        shots[kind] = {
            "url": url,
            "png": str(path),
            "bytes": path.stat().st_size if path.exists() else 0,
            "rendered": "Reward over steps" in rendered,
            "attempts": attempt + 1,
        }
    text = card["data"]
    served = re.search(r"servers serve policy \*\*v(\d+)\*\* \(reloaded in ([\d.]+) s\)", text)
    latest = (
        text.split("newest first\n\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:] if "newest first\n\n" in text else []
    )
    chart = text.split("```text\n", 1)[1].split("```", 1)[0] if "```text\n" in text else ""
    return {
        "step": step,
        "total_steps": total,
        "phase": re.search(r"\*\*(\w+)\*\* phase", text)[1],
        "served_version": int(served[1]) if served else None,
        "reload_s": float(served[2]) if served else None,
        "latest_steps_rows": len(latest),
        "newest_row": latest[0] if latest else None,
        "chart_points": sum(
            line.split("┤", 1)[1].count("·") + line.split("┤", 1)[1].count("o")
            for line in chart.splitlines()
            if "┤" in line
        ),
        "card": text,
        "shots": shots,
    }


def chromium_run(
    chromium: str, arguments: list[str], window: str = "1400,2000", timeout_s: float = 180
) -> subprocess.CompletedProcess:
    """Headless Chromium on a page of the UI, with a profile of its own (the README's screenshots
    take theirs with it too: docs/screenshot_prefect_ui.py). Without the background-networking
    flags Chromium keeps dialling Google's hosts."""
    with tempfile.TemporaryDirectory(prefix="ui-watch-chromium-") as profile:
        return subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--hide-scrollbars",
                f"--window-size={window}",
                "--virtual-time-budget=30000",
                *arguments,
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


if __name__ == "__main__":
    main()

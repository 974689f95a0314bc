"""What a person watching the Prefect UI sees while `clotho demo` runs: a real `prefect server start`
(fresh home), the demo against it, and at about a third and two thirds of its steps a headless
Chromium screenshot of the live card and of the pipeline run's page, with what the card held then.

    .venv/bin/python bench/ui_watch.py [--out .clotho/ui-watch] [--port 4210] [--at 0.33 0.67]

Writes OUT/at-33-live.png, OUT/at-33-run.png, ... and OUT/ui_watch.json (per moment: the step, the
card's facts, the screenshots). Needs chromium (or CHROMIUM=path)."""

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
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".clotho" / "ui-watch")
    parser.add_argument("--port", type=int, default=4210)
    parser.add_argument("--at", type=float, nargs="+", default=[0.33, 0.67], help="Fractions of the run's steps to shoot at.")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    args = parser.parse_args()
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("ui_watch: no chromium found; install it or set CHROMIUM=path")
    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="clotho-ui-watch-"))
    ui = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "PREFECT_HOME": str(home / "prefect"), "PREFECT_API_URL": f"{ui}/api", "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}  # fmt: skip
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--port", str(args.port)], env=env,
                              stdout=(args.out / "server.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    demo = None
    moments: list[dict] = []
    try:
        wait_healthy(f"{ui}/api", 120)
        started = datetime.now(timezone.utc)
        demo = subprocess.Popen([str(BIN / "clotho"), "demo"], cwd=REPO, env=env,
                                stdout=(args.out / "demo.log").open("w"), stderr=subprocess.STDOUT)  # fmt: skip
        targets = sorted(args.at)
        deadline = time.monotonic() + args.timeout_s
        while demo.poll() is None and targets and time.monotonic() < deadline:
            card = live_card(f"{ui}/api", started)
            found = card and re.search(r"step \*\*(\d+)\*\* of (\d+)", card["data"])
            if found and int(found[1]) >= targets[0] * int(found[2]):
                fraction = targets.pop(0)
                moments.append(shoot(chromium, ui, card, int(found[1]), int(found[2]), fraction, args.out))
                print(f"ui_watch: step {found[1]} of {found[2]}: {moments[-1]['shots']}", flush=True)
            time.sleep(2.0)
        if demo.poll() is None and not targets:
            demo.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if demo is not None and demo.poll() is None:
            demo.terminate()
            demo.wait(60)
        os.killpg(server.pid, 15)
        server.wait(60)
        shutil.rmtree(home, ignore_errors=True)
    report = {"demo_exit": demo.returncode if demo else None, "moments": moments}
    (args.out / "ui_watch.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def wait_healthy(api: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{api}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the Prefect server at {api} was not healthy in {timeout_s:.0f} s")


def live_card(api: str, since: datetime) -> dict | None:
    body = {"artifacts": {"key": {"any_": ["pipeline-demo-live"]}}, "sort": "CREATED_DESC", "limit": 1}
    cards = httpx.post(f"{api}/artifacts/filter", json=body, timeout=30).json()
    cards = [c for c in cards if datetime.fromisoformat(c["created"].replace("Z", "+00:00")) >= since]
    return cards[0] if cards else None


def shoot(chromium: str, ui: str, card: dict, step: int, total: int, fraction: float, out: Path) -> dict:
    """Screenshots of the live card's page and the pipeline run's page, and what the card said."""
    name = f"at-{round(100 * fraction)}"
    pages = {"live": f"{ui}/artifacts/artifact/{card['id']}", "run": f"{ui}/runs/flow-run/{card['flow_run_id']}"}
    shots = {}
    for kind, url in pages.items():
        path = out / f"{name}-{kind}.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={path}",
                        "--window-size=1400,2000", "--virtual-time-budget=20000", url],
                       capture_output=True, timeout=120)  # fmt: skip
        shots[kind] = {"url": url, "png": str(path), "bytes": path.stat().st_size if path.exists() else 0}
    text = card["data"]
    served = re.search(r"servers serve policy \*\*v(\d+)\*\* \(reloaded in ([\d.]+) s\)", text)
    latest = text.split("newest first\n\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:] if "newest first\n\n" in text else []
    chart = text.split("```text\n", 1)[1].split("```", 1)[0] if "```text\n" in text else ""
    return {
        "fraction": fraction, "step": step, "total_steps": total, "phase": re.search(r"\*\*(\w+)\*\* phase", text)[1],
        "served_version": int(served[1]) if served else None, "reload_s": float(served[2]) if served else None,
        "latest_steps_rows": len(latest), "newest_row": latest[0] if latest else None,
        "chart_points": chart.count("·") + chart.count("o") - 2, "card": text, "shots": shots,
    }  # fmt: skip


if __name__ == "__main__":
    main()

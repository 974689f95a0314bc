"""Takes the README's Prefect UI screenshots: a real rollout flow run, rendered by headless Chromium.

    python docs/screenshot_prefect_ui.py --server http://127.0.0.1:8000 --tokenizer MODEL_DIR

Needs Debian's chromium (`apt-get install chromium`). Writes docs/prefect-flow-run.png (timeline of
task runs, logs) and docs/prefect-rollout-stats.png (the per-environment stats artifact).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.ui_watch import chromium_run  # noqa: E402
from clotho.testing.prefect_server import start_prefect_server  # noqa: E402


def screenshot(url: str, out: Path) -> None:
    chromium_run("chromium", [f"--screenshot={out}", url], window="1500,1000", timeout_s=120).check_returncode()
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="policy server base URL")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--groups", type=int, default=24)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="clotho-ui-"))
    prefect = start_prefect_server(work / "prefect")
    try:
        clotho = str(Path(sys.executable).with_name("clotho"))
        subprocess.run(
            [
                clotho,
                "rollout",
                "--env",
                "environments.bundled.arithmetic:Arithmetic",
                "--env",
                "environments.bundled.guess_number:GuessNumber",
                "--storage",
                f"file://{work}/store",
                "--run",
                "ui-demo",
                "--server",
                args.server,
                "--tokenizer",
                args.tokenizer,
                "--groups",
                str(args.groups),
                "--shard-max-groups",
                "8",
                "--set",
                "group_size=4",
                "--set",
                "max_tokens=8",
            ],
            env=prefect.env(),
            check=True,
        )
        time.sleep(3)  # let the server settle the last task-run records
        runs = httpx.post(f"{prefect.api_url}/flow_runs/filter", json={}, timeout=30).json()
        run_id = runs[0]["id"]
        screenshot(f"{prefect.ui_url}/runs/flow-run/{run_id}", REPO / "docs" / "prefect-flow-run.png")
        # The per-environment stats table artifact of that run, on its own page.
        artifacts = httpx.post(
            f"{prefect.api_url}/artifacts/filter",
            json={"artifacts": {"flow_run_id": {"any_": [run_id]}, "type": {"any_": ["table"]}}},
            timeout=30,
        ).json()
        screenshot(
            f"{prefect.ui_url}/artifacts/artifact/{artifacts[0]['id']}",
            REPO / "docs" / "prefect-rollout-stats.png",
        )
    finally:
        prefect.stop()


if __name__ == "__main__":
    main()

"""Host-loss trials (issue 33): `clotho run` across the cluster of cluster/ (Prefect and S3 on a,
the policy server on b, a rollout worker and a trainer node on each of c and d, the pipeline on a),
and host c killed whole (every process, SIGKILL) at a random moment of the run, back after a pause,
its work dir's disk lost too in the odd trials. The run must end on its own: every step published,
no group consumed untrained (lost), none trained twice, no torn shard, checked from the run's files
as `make soak` checks them (soak.checks.run_tally), and the server on the last version.

    python -m soak.host_loss --trials 5 [--seed 0] [--out soak-results/host-loss.json]   (root; make cluster-trials)

One JSON row per trial, and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import time
from pathlib import Path

from cluster.hosts import (
    AUTH,
    KEY,
    Cluster,
    deploy_loop,
    loop_config,
    serve,
    start_shared_services,
    start_workers,
    tally,
    unavailable,
)

STEPS = 8
BACK_AFTER_S = 15.0  # c is down this long before it comes back (its workers start again)


def trainer_steps(c: Cluster, run: str) -> int:
    """The trainer's published position in the run (0 before one)."""
    out = c.run(
        "d",
        f'{c.s3_env()} python -c "from storage.progress import read_trainer_position; '
        f"p = read_trainer_position('s3://runs', '{run}'); print(p.policy_version if p else 0)\"",
        check=False,
    ).stdout
    lines = out.strip().splitlines()
    return int(lines[-1]) if lines and lines[-1].isdigit() else 0


def step_times(c: Cluster, run: str) -> dict[int, float]:
    """Each step's metrics row's wall time (the trainer's clock: this machine's)."""
    out = c.run(
        "d",
        f'{c.s3_env()} python -c "import json; from storage.progress import read_step_metrics; '
        f"rows = [read_step_metrics('s3://runs', '{run}', s) for s in range(1, {STEPS} + 1)]; "
        "print(json.dumps({r['step']: r['time'] for r in rows if r}))\"",
    ).stdout
    return {int(step): when for step, when in json.loads(out.strip().splitlines()[-1]).items()}


def trial(c: Cluster, index: int, rng: random.Random) -> dict:
    run = f"loss-{index}"
    server = serve(c, f"vllm-{run}", 8100 + index, f"s3://runs/{run}")
    at_step, delay, wipe = (
        rng.randint(1, STEPS - 3),
        rng.uniform(0.0, 4.0),
        index % 2 == 1,
    )  # odd trials: c's disk lost too
    c.run("a", f"cat > /tmp/{run}.yaml << 'EOF'\n{loop_config(c, f's3://runs/{run}', server, STEPS)}\nEOF")
    started = time.time()
    c.spawn(
        "a", f"run-{run}", f"{c.s3_env()} {c.api_env()} CLOTHO_API_KEY={KEY} clotho run /tmp/{run}.yaml; echo exit $?"
    )
    deadline = time.monotonic() + 600
    while (steps := trainer_steps(c, run)) < at_step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run}: not at step {at_step} in 600 s:\n{c.log('a', f'run-{run}')[-3000:]}")
        time.sleep(0.5)
    time.sleep(delay)
    steps = trainer_steps(c, run)
    killed_at = time.time()
    c.kill("c")
    if wipe:  # its disk lost with it: the trainer's work dir (resume state, metrics.jsonl) is gone
        os.system(f"rm -rf {c.root / 'c' / 'tmp' / f'train-{run}'}")
    time.sleep(BACK_AFTER_S)
    start_workers(c, "c", suffix=f"-{run}")
    c.wait_exit("a", f"run-{run}", 900)
    ran = c.log("a", f"run-{run}")
    tallied = tally(c, f"s3://runs/{run}")
    served = c.run("d", f"curl -s -m 5 {AUTH} {server}/weight_info", check=False).stdout
    c.stop("b", f"vllm-{run}")
    times = step_times(c, run)
    after = [when for step, when in times.items() if step > steps and when > killed_at]
    row = {
        "trial": index,
        "killed_at_step": steps,
        "disk_lost": wipe,
        "exit": ran.strip().splitlines()[-1] if ran.strip() else "",
        "restarts": len(re.findall(r"flow run \S*train-node\S* crashed .*starting it again", ran)),
        "rollout_restarts": len(re.findall(r"flow run (?!\S*train-node)\S+ crashed .*starting it again", ran)),
        "recovery_s": round(min(after) - killed_at, 1) if after else None,
        "minutes": round((time.time() - started) / 60, 2),
        "steps": tallied["steps"],
        "committed": tallied["committed"],
        "lost": tallied["lost"],
        "twice": tallied["twice"],
        "torn": len(tallied["torn"]),
        "regressions": len(tallied["regressions"]),
        "stale": tallied["stale"],
        "unread": tallied["unread"],
        "served": json.loads(served).get("weight_version") if served.strip().startswith("{") else None,
    }
    row["ok"] = (
        row["exit"] == "exit 0"
        and row["steps"] == list(range(1, STEPS + 1))
        and not (row["lost"] or row["twice"] or row["torn"] or row["regressions"])
        and row["served"] == str(STEPS)
    )
    if not row["ok"]:
        row["log_tail"] = ran[-3000:]
        # The whole logs beside the results: the pipeline's, and each node's trainer log and workers'.
        kept = Path("soak-results") / f"host-loss-{run}"
        kept.mkdir(parents=True, exist_ok=True)
        (kept / "pipeline.log").write_text(ran)
        for host in ("c", "d"):
            for log in [*(c.root / host / "tmp").glob("*.log"), *(c.root / host / "tmp").glob(f"train-{run}/*.log")]:
                shutil.copy(log, kept / f"{host}-{log.name}")
        row["logs"] = str(kept)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| trial | killed at step | disk lost | trainer restarts | rollout restarts | recovery (s) | minutes | "
        "committed | lost | twice | torn | stale | served | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['trial']} | {r['killed_at_step']} | {'yes' if r['disk_lost'] else 'no'} | {r['restarts']} | "
            f"{r.get('rollout_restarts')} | {r['recovery_s']} | "
            f"{r['minutes']} | {r['committed']} | {r['lost']} | {r['twice']} | {r['torn']} | {r['stale']} | v{r['served']} | "
            f"{'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="soak-results/host-loss.json")
    args = parser.parse_args()
    if reason := unavailable():
        raise SystemExit(f"no cluster on this machine: {reason}")
    rng = random.Random(args.seed)
    c = Cluster(f"hl{os.getpid() % 100000}")
    c.down()
    c.up()
    rows = []
    try:
        start_shared_services(c)
        deploy_loop(c)
        for host in ("c", "d"):
            start_workers(c, host)
        for index in range(1, args.trials + 1):
            rows.append(trial(c, index, rng))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "log_tail"}), flush=True)
    finally:
        c.down()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"trials": rows, "seed": args.seed, "steps": STEPS}, indent=1))
    print(table(rows))
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

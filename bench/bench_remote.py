"""What serving an environment costs: a group collected in process vs through `clotho env serve`.

    python -m bench.bench_remote [--rounds 6] [--groups 12] [--only base,textarena]

For each adapter whose virtual environment exists (.venv for the bundled `base` environment,
.venv-env-NAME for the adapters; `make .venv-env-NAME/.installed` builds one), one tiny-model vLLM
server and the adapter's service (`clotho env serve`, from that venv) are started, then every round
runs three sides, their order rotating by round, each a fresh probe process of that venv's Python
collecting --groups groups one after another (after two warm-up groups):
- inproc: the environment imported in the probe's process;
- remote: the same environment and config by the service's URL;
- inproc_again: in process once more, the control.
Reported per adapter: mean seconds per group per side, the ratio remote / inproc per round with its
95% interval over rounds, the control, the added milliseconds per group, and the venv's size.
Written to bench/results/remote.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from bench.results import interval, write_result
from environments.testing import cached_tiny_model, serve_environment
from inference.server import PolicyServer

REPO = Path(__file__).resolve().parents[1]

# adapter -> (its venv, the environment in it, the config both sides run)
EXAMPLES = "environments.adapters.examples"
ADAPTERS = {
    "base": (".venv", "arithmetic", {"group_size": 4, "max_tokens": 8}),
    "textarena": (
        ".venv-env-textarena",
        "environments.adapters.textarena:TextArena",
        {"game": "SimpleNegotiation-v0-short", "group_size": 2, "max_tokens": 8},
    ),
    "openenv": (
        ".venv-env-openenv",
        "environments.adapters.openenv:OpenEnv",
        {"environment": f"{EXAMPLES}.openenv_echo:EchoEnvironment", "group_size": 2, "max_tokens": 8, "max_turns": 3},
    ),
    "atropos": (
        ".venv-env-atropos",
        "environments.adapters.atropos:Atropos",
        {
            "env": f"{EXAMPLES}.atropos_managed:AdditionManagedEnv",
            "group_size": 3,
            "env_config": {"max_token_length": 8},
        },
    ),
    "verifiers": (
        ".venv-env-verifiers",
        "environments.adapters.verifiers:Verifiers",
        {
            "env": {"taskset": {"id": f"{EXAMPLES}.verifiers_arithmetic", "num_tasks": 8}},
            "group_size": 2,
            "max_tokens": 12,
        },
    ),
}


def probe(python: Path, environment: str, config: dict, server: str, tokenizer: str, groups: int) -> float:
    """Mean seconds per group, measured inside a fresh probe process."""
    done = subprocess.run(
        [str(python), "-m", "bench.remote_probe", environment, json.dumps(config), server, tokenizer, str(groups)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"probe of {environment} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["mean_s"]


def venv_size_mb(venv: Path) -> float:
    done = subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True, check=True)
    return float(done.stdout.split()[0])


def measure(name: str, server: str, tokenizer: str, rounds: int, groups: int) -> dict:
    venv_name, environment, config = ADAPTERS[name]
    venv = REPO / venv_name
    python = venv / "bin" / "python"
    served = serve_environment(environment, clotho=venv / "bin" / "clotho", timeout=300)
    try:
        sides = {"inproc": environment, "remote": served.url, "inproc_again": environment}
        per_round = []
        for index in range(rounds):
            order = list(sides)[index % 3 :] + list(sides)[: index % 3]
            measured = {side: probe(python, sides[side], config, server, tokenizer, groups) for side in order}
            per_round.append(measured)
            print(
                name, json.dumps({side: round(s * 1e3, 1) for side, s in measured.items()}), "ms per group", flush=True
            )
    finally:
        served.stop()
    ratios = [r["remote"] / r["inproc"] for r in per_round]
    control = [r["inproc_again"] / r["inproc"] for r in per_round]
    mean = {side: statistics.fmean(r[side] for r in per_round) for side in sides}
    return {
        "environment": environment,
        "config": config,
        "rounds": per_round,
        "mean_s": {side: round(seconds, 5) for side, seconds in mean.items()},
        "added_ms_per_group": round((mean["remote"] - mean["inproc"]) * 1e3, 2),
        "ratio_remote_to_inproc": round(statistics.fmean(ratios), 3),
        "ratio_interval": interval(ratios),
        "ratio_control": round(statistics.fmean(control), 3),
        "control_interval": interval(control),
        "venv_mb": venv_size_mb(venv),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--groups", type=int, default=12, help="groups per probe, after two warm-up groups")
    parser.add_argument("--server", default=None, help="a running tiny-model policy server (default: start one)")
    parser.add_argument("--only", default=None, help="comma-separated adapters (default: every one whose venv exists)")
    args = parser.parse_args()
    names = (
        args.only.split(",")
        if args.only
        else [n for n, (venv, _, _) in ADAPTERS.items() if (REPO / venv / "bin" / "clotho").exists()]
    )
    model = cached_tiny_model()
    server = (
        None
        if args.server
        else PolicyServer(model, log_path=REPO / ".clotho" / "logs" / "bench-remote-vllm.log").start(timeout=600)
    )
    try:
        url = args.server or server.base_url
        results = {name: measure(name, url, str(model), args.rounds, args.groups) for name in names}
    finally:
        if server is not None:
            server.stop()
    for name, result in results.items():
        print(name, json.dumps({k: v for k, v in result.items() if k not in ("rounds", "config")}))
    write_result("remote", {"groups_per_probe": args.groups, "adapters": results})


if __name__ == "__main__":
    main()

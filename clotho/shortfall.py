"""A command that ends with too little of what it was asked for fails: its exit code and its one line.

`clotho rollout` and `clotho evaluate` end normally even when every group or answer failed (each
failure is data, kept and counted). They then exit with SHORTFALL_EXIT, not 0, when less than
MIN_SHARE of what they tried was made, with one line naming the most frequent failure reason and
its fix: a script or a scheduler sees a run that did nothing as the failure it is.
"""

from __future__ import annotations

SHORTFALL_EXIT = 3
MIN_SHARE = 0.5  # of what was tried: below it the command failed (README, under the command table)

# What to do about each failure reason (environments.failures.FAILURE_REASONS), {server} filled in.
FIXES = {
    "unreachable": "no policy server answered at {server}: start one with `clotho serve MODEL --port PORT` and pass "
    "its base URL as --server",
    "timeout": "groups ran past the environment's group_timeout_s: raise it (--set group_timeout_s=SECONDS) or run "
    "fewer groups at once (--max-concurrent-groups)",
    "infra": "the machinery failed, not the candidates (a sandbox starved of CPU, a judge or service that did not "
    "answer): rerun on a less loaded host or raise the environment's limits",
    "exception": "the environment raised: the failures' errors are in the log above and the flow run's artifacts "
    "(Prefect UI); `clotho env check ENV` runs its conformance suite",
    "dropped-by-environment": "the environment dropped every group by its own filters (say, all scores equal): "
    "change its config so that groups differ",
}
CONTRACT_FIX = "the environment's groups break the ScoredGroup contract: `clotho env check ENV` names the field"


def shortfall(command: str, what: str, made: int, failures_by_reason: dict[str, int], server: str = "") -> str | None:
    """None when `made` is at least MIN_SHARE of what was tried (made + failed); else the one line
    the command ends with: how much it made, the most frequent failure reason and its fix."""
    failed = sum(failures_by_reason.values())
    if made >= MIN_SHARE * (made + failed) or not failed:
        return None
    reason, count = max(failures_by_reason.items(), key=lambda kv: kv[1])
    fix = FIXES.get(reason, CONTRACT_FIX).format(server=server or "the --server URL")
    return f"{command}: {made} {what} made, {failed} failed (more than {1 - MIN_SHARE:.0%}); {count} as {reason}: {fix}"

"""A server that stops answering in the middle of a reload (SIGSTOP) holds it up for a bounded time:
the reload fails within inference.reload.reload_bound_s, and once the server answers again it is
resumed and restored to the version it served, never left paused."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import psutil
import pytest

from clotho.testing.reloading import announced, is_paused, next_step, perturbed_checkpoint, served_matches
from inference import reload
from inference.client import PolicyClient
from inference.reload import reload_bound_s
from inference.watcher import ReloadWatcher
from storage.checkpoints import publish_checkpoint

pytestmark = pytest.mark.integration

STEP_TIMEOUT_S = 2.0
STOPPED_S = 6.0  # past the bound: the reload gives up while the server is still stopped
RESTORE_TIMEOUT_S = 60.0


def api_server_pid(policy) -> int:
    """The vLLM API server's process (the one answering HTTP), below its tether (core/tether.py)."""
    tether = psutil.Process(policy.server.process.pid)
    return next(p.pid for p in tether.children() if "vllm" in " ".join(p.cmdline()))


async def test_a_server_stopped_mid_reload_is_given_up_within_the_bound_then_restored(
    untied_policy, guard, tmp_path, monkeypatch
):
    policy, root = untied_policy, f"file://{tmp_path}/store"
    version, weights = policy.version, policy.weights_dir
    pid = api_server_pid(policy)
    stopped: list[float] = []
    original = PolicyClient.request

    async def stop_after_pause(self, method, path, **kwargs):
        response = await original(self, method, path, **kwargs)
        if path == "/pause" and not stopped:  # the server paused, then it stops answering
            os.kill(pid, signal.SIGSTOP)
            stopped.append(time.monotonic())
            asyncio.get_running_loop().call_later(STOPPED_S, os.kill, pid, signal.SIGCONT)
        return response

    monkeypatch.setattr(PolicyClient, "request", stop_after_pause)
    restoring: list[float] = []
    original_restore = reload.restore_server

    async def timed_restore(target, guard, reload_root, client=None):
        restoring.append(time.monotonic())
        # The bound under test is the hang's. The restore's calls get a timeout that a server just
        # continued on a loaded CI host meets (it first works off the stopped reload): 2 s did not.
        target.step_timeout_s = RESTORE_TIMEOUT_S
        return await original_restore(target, guard, reload_root)

    monkeypatch.setattr(reload, "restore_server", timed_restore)
    monkeypatch.setattr(policy, "step_timeout_s", STEP_TIMEOUT_S)
    step = next_step(policy)
    publish_checkpoint(perturbed_checkpoint(weights, tmp_path / "new", seed=3), root, "run", step)
    watcher = ReloadWatcher(f"{root}/run", [policy], guard, cache_dir=tmp_path / "cache", poll_s=0.2)
    try:
        started = time.monotonic()
        [outcome] = await watcher.poll_once()
        given_up_s = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert stopped, "the reload never paused the server"
    # The stopped call was given up within the bound; the restore waited for the server to answer again.
    assert outcome.status == "failed" and f"restored in place to version {version}" in outcome.detail, outcome
    assert restoring and restoring[0] - stopped[0] <= reload_bound_s(STEP_TIMEOUT_S) + 1.0, restoring[0] - stopped[0]
    assert STOPPED_S <= given_up_s < STOPPED_S + 60, given_up_s
    assert not await is_paused(policy) and await announced(policy) == version and policy.healthy
    assert await served_matches(policy, weights) < 1e-4

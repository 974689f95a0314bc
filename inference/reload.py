"""The hot-reload protocol against one vLLM server: swap weights in place, prove parity, announce.

    preflight (tensor names and shapes)          server untouched if the checkpoint is incomplete
    POST /pause?mode=keep                        requests in flight frozen where they are (in-flight)
    POST /collective_rpc reload_weights {dir}    new weights in place (~0.05 s for the tiny model)
    POST /update_weight_version {"N unverified, announced M"}
                                                 every token sampled from now on is tagged N
    POST /reset_prefix_cache?reset_running_requests=true
                                                 the KV cache is the old weights' work: dropped, and
                                                 the frozen requests' recomputed by the new weights
    POST /resume                                 always (a server that stopped answering: once it answers)
    parity guard on fixed prompts                served logprobs == transformers on the checkpoint
    POST /update_weight_version {N}              only now is version N announced

In-flight (the default, as PipelineRL and AReaL do it) never waits for the requests in flight: a
long generation spans the swap, its tokens before it sampled (with their logprobs) by the old
weights and those after it by the new ones, on a prefix whose KV the new weights recomputed, so
every token is exactly what the weights that sampled it give (no stale cache). `drain` is the
older protocol: pause(wait) lets every request in flight finish on the old weights, and the longest
of them sets how long sampling stops.

Why resume before the parity check: requests (the guard's too) are not scheduled while the engine is
paused. vLLM stamps each token it samples with its weight version tag, and the tag changes while the
engine is paused, so a sequence says exactly which version sampled each of its tokens
(inference.client reads the spans; a sequence that spans the swap records both). The tag names the
announced version too (inference.client.version_tag): the run reads version M as served until
parity holds and N is announced.

On a parity failure or a server error mid-swap, the server goes back to the weights it served before
(reloaded in place and checked again, or, if that fails and clotho owns the process, a restart), and
the new version is never announced. Every call is bounded (ServedPolicy.step_timeout_s): a server
that stops answering mid-reload (a hung engine, a stopped process) holds the reload up for at most
reload_bound_s before it is restored, so a paused server is never left paused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from inference.client import PolicyClient, PolicyServerError, PolicyServerUnreachable, version_tag
from inference.parity_guard import ParityGuard, ParityMismatch, ParityReport
from inference.server import PolicyServer
from inference.weights import IncompatibleCheckpoint, check_compatible, config_differences, prepare_reload_dir

log = logging.getLogger(__name__)

SERVER_ERRORS = (PolicyServerError, PolicyServerUnreachable)
ReloadMode = Literal["in-flight", "drain"]


class ReloadError(RuntimeError):
    """A server could not be moved to a new version; the watcher reports it and tries again."""


class CheckpointRejected(ReloadError):
    """The checkpoint cannot be served (incomplete, or failed parity); the old version stays announced."""


@dataclass
class ServedPolicy:
    """One vLLM server kept at the newest verified checkpoint, and what it serves now.

    `weights_dir` is the local directory of the weights the server serves and that passed parity:
    the place a fallback returns to. `server` is set when clotho started the process, which allows
    the restart fallback; servers started elsewhere can only be reloaded in place.
    """

    base_url: str
    weights_dir: Path
    version: int = 0
    api_key: str | None = field(default=None, repr=False)  # a repr lands in logs and tracebacks
    model_name: str = "policy"
    server: PolicyServer | None = None
    healthy: bool = True  # False when its weights or pause state are unknown after a failure
    rejected: set[int] = field(default_factory=set)  # versions that failed here; not retried
    reload_mode: ReloadMode = "in-flight"  # or "drain": requests in flight finish on the old weights first
    # The parity check's request priority: URGENT on a server clotho started with priority
    # scheduling (it goes before the generation waiting); 0 on a server started elsewhere, which
    # may refuse any other (vLLM without --scheduling-policy priority).
    check_priority: int = 0
    # How long one call of a reload (pause, reload_weights, tag, reset, resume, a parity request) may
    # take before it is tried once more and then given up: see reload_bound_s.
    step_timeout_s: float = 120.0

    @classmethod
    def of(
        cls,
        server: PolicyServer,
        version: int = 0,
        reload_mode: ReloadMode = "in-flight",
        step_timeout_s: float = 120.0,
    ) -> ServedPolicy:
        """The policy served by a PolicyServer clotho started (its model must be a local directory)."""
        weights = Path(server.model)
        if not (weights / "config.json").exists():
            raise ValueError(
                f"{server.model} is not a local model directory; hot reload needs the served weights on "
                "disk as the fallback: download the model (huggingface-cli download) and serve that directory"
            )
        priority = server.urgent_priority
        return cls(
            server.base_url,
            weights,
            version,
            server.api_key,
            server.served_model_name,
            server,
            reload_mode=reload_mode,
            check_priority=priority,
            step_timeout_s=step_timeout_s,
        )

    def client(self) -> PolicyClient:
        # Few retries, each call bounded: a dead or hung server must be reported within a bound, not
        # after a minute of backoff or the default timeout's minutes (reload_bound_s).
        return PolicyClient(
            self.base_url,
            model=self.model_name,
            api_key=self.api_key,
            timeout=self.step_timeout_s,
            max_retries=STEP_TRIES - 1,
            backoff=0.2,
        )


STEP_TRIES = 2  # a reload's call that fails or times out is tried once more


def reload_bound_s(step_timeout_s: float) -> float:
    """How long a server that stops answering in the middle of a reload can hold it up before the
    watcher knows: the call it hangs in times out on each of its STEP_TRIES. The reload then fails
    and the server is brought back (restore_server: resumed, its verified weights swapped back in,
    each call bounded the same way, or a server clotho started restarted on them; one that cannot
    be reached is marked unhealthy and restored again at each poll until it answers)."""
    return STEP_TRIES * step_timeout_s + 1.0  # + the client's backoff between the tries


@dataclass(frozen=True)
class ReloadReport:
    """A version a server now serves and announces, with where the time went."""

    base_url: str
    version: int
    swap_s: float  # pause -> reload -> reset -> resume
    parity: ParityReport
    total_s: float  # preflight to announcement


async def swap_weights(
    client: PolicyClient, weights_dir: str | Path, mode: ReloadMode = "in-flight", tag: str | None = None
) -> float:
    """pause -> reload_weights -> tag -> reset_prefix_cache -> resume (see the module docstring for
    the two modes); the server is never left paused by a swap it answers (a failed step still
    resumes it; one that stopped answering is resumed by restore_server once it answers again:
    a resume now would wait as long again). `tag` is the weight version tag the tokens sampled
    after the swap carry (inference.client.version_tag)."""
    if not (Path(weights_dir) / "config.json").exists():
        # vLLM takes a path it cannot find for a Hugging Face repo id and goes to the network.
        raise FileNotFoundError(f"{weights_dir} is not a model directory (no config.json); nothing was reloaded")
    started = time.perf_counter()
    in_flight = mode == "in-flight"
    await client.request("POST", "/pause", params={"mode": "keep" if in_flight else "wait"})
    try:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
        await client.request("POST", "/collective_rpc", json=rpc)
        if tag is not None:  # the weights in place now are the tag's
            await set_tag(client, tag)
        # With requests frozen mid-generation their KV blocks are in use: preempting them is what
        # lets the cache go, and they resume by recomputing their prefix on the new weights.
        await client.request(
            "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"} if in_flight else None
        )
    except PolicyServerUnreachable:
        raise
    except BaseException:
        await client.request("POST", "/resume")
        raise
    await client.request("POST", "/resume")
    return time.perf_counter() - started


async def set_tag(client: PolicyClient, tag: str) -> None:
    """The engine's weight version tag: what every token it samples from now on is stamped with,
    and what weight_version() reads (inference.client.version_tag)."""
    await client.request("POST", "/update_weight_version", json={"new_version": tag})


async def announce(client: PolicyClient, version: int) -> None:
    await set_tag(client, version_tag(version))


async def ensure_resumed(client: PolicyClient) -> None:
    """Resumes a server a failed swap may have left paused (its /resume never arrived)."""
    if (await client.request("GET", "/is_paused")).json().get("is_paused"):
        log.warning("%s was left paused by an interrupted reload; resuming it", client.base_url)
        await client.request("POST", "/resume")


async def reload_server(
    target: ServedPolicy,
    checkpoint_dir: str | Path,
    version: int,
    guard: ParityGuard,
    reload_root: str | Path,
) -> ReloadReport:
    """Moves one server to the checkpoint in place and announces `version` once parity holds.

    Raises CheckpointRejected when the checkpoint is incomplete, vLLM refuses it or parity fails (the
    server still serves and announces its previous version; this version is not retried there), or
    ReloadError when the server stops answering (restored when possible, else marked unhealthy).
    """
    started = time.perf_counter()
    checkpoint_dir = Path(checkpoint_dir)
    try:
        check_compatible(checkpoint_dir, target.weights_dir)
        reload_dir = prepare_reload_dir(checkpoint_dir, reload_root)
    except (IncompatibleCheckpoint, FileNotFoundError) as error:
        target.rejected.add(version)
        message = f"version {version} rejected before reload, {target.base_url} untouched: {error}"
        raise CheckpointRejected(message) from error
    async with target.client() as client:
        target.healthy = False  # until the new weights pass parity or the old ones are back
        try:
            swap_s = await swap_weights(
                client, reload_dir, target.reload_mode, tag=version_tag(version, target.version)
            )
            parity = await guard.check(client, checkpoint_dir, priority=target.check_priority)
        except PolicyServerUnreachable as error:
            message = f"reload of version {version} on {target.base_url} failed: {error}"
            restored = await _fall_back(target, guard, reload_root, client, message)
            raise ReloadError(f"{message}; {restored}") from error
        except Exception as error:  # a mismatch, vLLM refusing the weights, transformers failing to load them
            target.rejected.add(version)
            message = f"version {version} rejected: {error}"
            if drift := config_differences(checkpoint_dir, target.weights_dir):
                message += (
                    f"; its config.json differs from the served one ({', '.join(drift)}), which an "
                    "in-place reload cannot apply: restart the server on the new model"
                )
            restored = await _fall_back(target, guard, reload_root, client, message)
            raise CheckpointRejected(f"{message}; {restored}") from error
        await announce(client, version)
    target.weights_dir, target.version, target.healthy = checkpoint_dir, version, True
    total_s = time.perf_counter() - started
    log.info(
        "%s now serves version %d: swap %.3fs, parity %.3fs (max |diff| %.2g), total %.3fs",
        target.base_url,
        version,
        swap_s,
        parity.seconds,
        parity.max_difference,
        total_s,
    )
    return ReloadReport(target.base_url, version, swap_s, parity, total_s)


async def _fall_back(
    target: ServedPolicy, guard: ParityGuard, reload_root: str | Path, client: PolicyClient, message: str
) -> str:
    log.error("%s; restoring version %d", message, target.version)
    try:
        return await restore_server(target, guard, reload_root, client)
    except ReloadError as error:
        raise ReloadError(f"{message}; then {error}") from error


async def restore_server(
    target: ServedPolicy, guard: ParityGuard, reload_root: str | Path, client: PolicyClient | None = None
) -> str:
    """Brings a server back to its verified weights and version; returns what it took.

    In place first (reload + parity); if that fails and clotho owns the process, a restart on those
    weights. Raises ReloadError when neither works, leaving the server marked unhealthy.
    """
    target.healthy = False  # until the verified weights are back
    own_client = client is None
    client = client or target.client()
    try:
        try:
            await ensure_resumed(client)
            await swap_weights(
                client,
                prepare_reload_dir(target.weights_dir, reload_root),
                target.reload_mode,
                tag=version_tag(target.version),
            )
            await guard.check(client, target.weights_dir, priority=target.check_priority)
            await announce(client, target.version)
            how = f"restored in place to version {target.version}"
        except (ParityMismatch, *SERVER_ERRORS) as error:
            if target.server is None:
                raise ReloadError(
                    f"{target.base_url} could not be restored to version {target.version} ({error}); it may "
                    f"serve unverified weights: restart it on {target.weights_dir}"
                ) from error
            how = await _restart(target, guard, client, error)
    finally:
        if own_client:
            await client.aclose()
    target.healthy = True
    log.warning("%s %s", target.base_url, how)
    return how


async def _restart(target: ServedPolicy, guard: ParityGuard, client: PolicyClient, cause: Exception) -> str:
    log.error("%s: in-place restore failed (%s); restarting it on %s", target.base_url, cause, target.weights_dir)
    started = time.perf_counter()
    try:
        await asyncio.to_thread(target.server.restart, target.weights_dir)
        await guard.check(client, target.weights_dir, priority=target.check_priority)
        await announce(client, target.version)  # a fresh server reports "default" until told
    except Exception as error:
        raise ReloadError(f"{target.base_url} failed to restart on {target.weights_dir}: {error}") from error
    return f"restarted on version {target.version} in {time.perf_counter() - started:.0f}s"

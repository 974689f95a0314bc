"""OpenEnv environments through clotho: the adapter served by `clotho env serve` from
.venv-env-openenv, with an OpenEnv environment class in process or an OpenEnv server by URL; one
token-exact sequence per episode, actions trained, observations not, the return from the
environment's rewards. This process never imports openenv: everything comes back over HTTP."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from core.scored_group import ScoredGroup, ScoredSequence
from environments.conformance import run_checks, trained_segments
from environments.loading import load_config, load_environment_class
from environments.remote import RemoteServiceError
from environments.testing import CACHE
from inference.client import PolicyClient
from inference.server import free_port
from tests.interop.conftest import ROOT, adapter_venv, rollout_groups, serve_adapter

pytestmark = pytest.mark.integration

ADAPTER = "environments.adapters.openenv:OpenEnv"
EXAMPLES = "environments.adapters.examples"
ECHO = f"{EXAMPLES}.openenv_echo:EchoEnvironment"
SPELL = {
    "environment": f"{EXAMPLES}.openenv_spell:SpellEnvironment",
    "parse": f"{EXAMPLES}.openenv_spell:parse_action",
    "render": f"{EXAMPLES}.openenv_spell:render_observation",
}
SPELL_WORDS = ("amber", "cloud", "maple", "piano", "river", "stone", "tiger", "velvet")  # the example's WORDS


@pytest.fixture(scope="module")
def served_openenv():
    served = serve_adapter("openenv", ADAPTER)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def tokenizer(policy_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy_tokenizer)


@pytest.fixture(scope="module")
def echo_server() -> str:
    """The echo environment's own OpenEnv server (uvicorn on openenv's create_app), in its venv."""
    yield from openenv_server("openenv_echo")


@pytest.fixture(scope="module")
def grid_server() -> str:
    """The grid example's server: one session at a time, as upstream grid_world's and connect4's."""
    yield from openenv_server("openenv_grid")


def openenv_server(example: str, python: Path | None = None, module_path: bool = False):
    """An OpenEnv server app (`app` of an example, or of any module) under uvicorn, until the test ends."""
    python = python or adapter_venv("openenv") / "bin" / "python"
    port = free_port()
    log_path = CACHE / "logs" / f"{example}-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    module = example if module_path else f"{EXAMPLES}.{example}"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(python), "-m", "uvicorn", f"{module}:app", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            stdout=log,
            stderr=log,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"the OpenEnv {example} server exited: {log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"the OpenEnv {example} server did not answer; see {log_path}"
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def collect(env_url: str, config: dict, policy_server, tokenizer: str) -> ScoredGroup:
    """One group from the served adapter, through the remote environment like the flow's."""
    env_class = load_environment_class(env_url)

    async def run() -> ScoredGroup:
        async with PolicyClient(policy_server.base_url, api_key=getattr(policy_server, "api_key", None)) as client:
            env = env_class(load_config(env_class, config), client=client, tokenizer=tokenizer)
            try:
                await env.setup()
                result = await env.sample_group(await env.get_item())
            finally:
                await env.aclose()
        assert isinstance(result, ScoredGroup), result
        return result

    return asyncio.run(run())


def turns(sequence: ScoredSequence, role: str) -> list[dict]:
    return [message for message in sequence.messages if message["role"] == role]


def assert_token_exact(sequence: ScoredSequence, tokenizer) -> None:
    """Each assistant message is the decoded sampled tokens of one trained run; each observation
    after the first lies in the untrained tokens between two actions."""
    actions, observations = turns(sequence, "assistant"), turns(sequence, "user")
    segments = trained_segments(sequence)
    assert len(segments) == len(actions) == sequence.extras["turns"]
    assert not any(sequence.mask[: segments[0][0]])
    for action, (start, end) in zip(actions, segments):
        assert tokenizer.decode(sequence.tokens[start:end], skip_special_tokens=True) == action["content"]
        assert all(logprob <= 0.0 for logprob in sequence.logprobs[start:end])
    assert observations[0]["content"] in tokenizer.decode(sequence.tokens[: segments[0][0]], skip_special_tokens=True)
    for observation, (_, before), (after, _) in zip(observations[1:], segments, segments[1:]):
        assert observation["content"] in tokenizer.decode(sequence.tokens[before:after], skip_special_tokens=True)


def assert_echo_episode(sequence: ScoredSequence, tokenizer, max_turns: int, discount: float) -> None:
    """The echo environment never ends an episode: max_turns actions, each echoed back as the next
    user turn, each rewarded 0.1 per character (the template's reward), the score their return."""
    assert_token_exact(sequence, tokenizer)
    actions, observations = turns(sequence, "assistant"), turns(sequence, "user")
    assert len(actions) == max_turns and sequence.extras["done"] is False
    assert observations[0]["content"] == "Echo environment ready!"
    assert [o["content"] for o in observations[1:]] == [
        a["content"] for a in actions[:-1]
    ]  # the whole text was the message
    assert [a["reward"] for a in actions] == pytest.approx([0.1 * len(a["content"]) for a in actions])
    assert sequence.score == pytest.approx(sum(discount**t * 0.1 * len(a["content"]) for t, a in enumerate(actions)))


def test_the_echo_environment_runs_in_process_through_the_rollout_flow_into_shards(
    served_openenv, prefect_server, policy_server, policy_tokenizer, tokenizer, tmp_path
) -> None:
    config = {"environment": ECHO, "group_size": 2, "max_tokens": 8, "max_turns": 3, "discount": 0.5}
    summary, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served_openenv.url,
        config,
        f"file://{tmp_path}/store/openenv",
        groups=2,
    )
    assert summary["totals"]["groups"] == 2 and len(groups) == 2
    for group in groups:
        assert group.env == "openenv" and len(group.sequences) == 2
        assert len({s.extras["episode_id"] for s in group.sequences}) == 2  # two episodes of one seed
        for sequence in group.sequences:
            assert_echo_episode(sequence, tokenizer, max_turns=3, discount=0.5)
    assert len({g.extras["item"]["extras"]["seed"] for g in groups}) == 2
    assert "openenv" not in sys.modules


@pytest.mark.parametrize("mode", ["in process", "server url"])
def test_the_echo_environment_passes_the_conformance_suite_by_url(
    mode, served_openenv, request, policy_server, policy_tokenizer
) -> None:
    environment = ECHO if mode == "in process" else request.getfixturevalue("echo_server")
    results = asyncio.run(
        run_checks(
            load_environment_class(served_openenv.url),
            {"environment": environment, "group_size": 2, "max_tokens": 8, "max_turns": 2},
            server_url=policy_server.base_url,
            tokenizer=policy_tokenizer,
            api_key=getattr(policy_server, "api_key", None),
        )
    )
    assert [(r.name, r.status, r.detail) for r in results if r.status != "passed"] == [
        ("gold answer scores top", "skipped", "skipped: no gold_completion")
    ]


def test_an_openenv_server_by_url_echoes_the_actions_and_sums_the_rewards(
    served_openenv, echo_server, policy_server, policy_tokenizer, tokenizer
) -> None:
    config = {"environment": echo_server, "group_size": 3, "max_tokens": 8, "max_turns": 3}
    group = collect(served_openenv.url, config, policy_server, policy_tokenizer)
    assert len(group.sequences) == 3 and not group.extras.get("rollout_errors")
    for sequence in group.sequences:
        assert_echo_episode(sequence, tokenizer, max_turns=3, discount=1.0)


def test_an_episode_ends_when_the_environment_says_done_with_its_own_parse_and_render(
    served_openenv, policy_server, policy_tokenizer, tokenizer
) -> None:
    config = {**SPELL, "group_size": 2, "max_tokens": 6, "max_turns": 5, "max_concurrent_episodes": 1}
    group = collect(served_openenv.url, config, policy_server, policy_tokenizer)
    assert len(group.sequences) == 2
    first_turns = {turns(s, "user")[0]["content"] for s in group.sequences}
    assert len(first_turns) == 1  # both episodes reset with the item's seed
    [first] = first_turns
    assert any(first == f"Type the word. Spell the word '{word}' (3 attempts left)." for word in SPELL_WORDS)
    for sequence in group.sequences:
        assert_token_exact(sequence, tokenizer)
        actions, observations = turns(sequence, "assistant"), turns(sequence, "user")
        assert sequence.extras["done"] is True and 1 <= len(actions) <= 3  # done before max_turns
        assert len(actions) == 3 or actions[-1]["reward"] == 1.0  # out of attempts, or typed the word
        assert all(o["content"].endswith(f"({3 - t} attempts left).") for t, o in enumerate(observations))
        assert sequence.score == sum(a["reward"] for a in actions)


def test_a_class_that_is_not_an_openenv_environment_is_refused_naming_it(
    served_openenv, policy_server, policy_tokenizer
) -> None:
    with pytest.raises(RemoteServiceError, match="is not an OpenEnv Environment subclass"):
        collect(
            served_openenv.url,
            {"environment": "environments.bundled.arithmetic:Arithmetic"},
            policy_server,
            policy_tokenizer,
        )


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["in process", "one-session server"])
def test_an_action_of_several_fields_runs_with_no_settings_and_a_one_session_server_queues(
    mode, request, served_openenv, policy_server, tokenizer
) -> None:
    """The grid example's action (a direction and a number of steps), as upstream grid_world's and
    connect4's are not messages: no parse given, its JSON schema asks for and reads the action; a
    reply that is no valid action ends that episode earning nothing. Its server takes one session
    at a time: four episodes at once wait for it in turn (CAPACITY_REACHED), none fails."""
    environment = (
        f"{EXAMPLES}.openenv_grid:GridEnvironment" if mode == "in process" else request.getfixturevalue("grid_server")
    )
    group = collect(
        served_openenv.url,
        {"environment": environment, "group_size": 4, "max_tokens": 16, "max_turns": 3},
        policy_server,
        tokenizer,
    )
    assert len(group.sequences) == 4 and not group.extras.get("rollout_errors"), group.extras
    for sequence in group.sequences:
        system = sequence.messages[0]
        assert system["role"] == "system" and '"direction"' in system["content"] and "metadata" not in system["content"]
        assert sequence.extras["done"] or "invalid_action" in sequence.extras or sequence.extras["turns"] == 3, (
            sequence.extras
        )
    refusals = sum(sequence.extras.get("capacity_refusals", 0) for sequence in group.sequences)
    assert (refusals > 0) == (mode == "one-session server"), refusals  # the server was full, and said so


UPSTREAM = ROOT / "tests" / "data" / "upstream" / "openenv" / "envs"  # unchanged copies: tests/data/upstream


# grid_world_env asks for Python >= 3.12 (its pyproject), so the layer holding the three is a whole
# venv on one (clotho/env_venv.py), built once for both the adapter and the environments' own servers.
UPSTREAM_PACKAGES = ("connect4_env", "echo_env", "grid_world_env")


def upstream_layer() -> Path:
    """The python of .venv-env-openenv's packages with the upstream environments' installed too, as
    their READMEs install them (`pip install` of the folder): what `clotho env serve --requirements DIR` builds."""
    python = adapter_venv("openenv") / "bin" / "python"
    folders = [str(UPSTREAM / name) for name in UPSTREAM_PACKAGES]
    code = (
        "from clotho.env_venv import environment_layer, pip_arguments; "
        f"print(environment_layer(pip_arguments([], {folders!r}), echo=lambda _: None))"
    )
    return Path(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip())


@pytest.fixture(scope="module")
def upstream_servers():
    """Each upstream environment's own server app, from its installed package, started once."""
    started = {}

    def server(name: str) -> str:
        if name not in started:
            generator = openenv_server(f"{name}.server.app", python=upstream_layer(), module_path=True)
            started[name] = (generator, next(generator))
        return started[name][1]

    yield server
    for generator, _ in started.values():
        generator.close()


@pytest.fixture(scope="module")
def served_upstream():
    """The adapter with connect4_env, echo_env and grid_world_env installed in its layer."""
    served = serve_adapter(
        "openenv", ADAPTER, tuple(arg for name in UPSTREAM_PACKAGES for arg in ("--requirements", str(UPSTREAM / name)))
    )
    yield served
    served.stop()


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["in process", "its own server"])
def test_upstream_connect4_runs_unchanged_with_no_settings(
    mode, served_upstream, upstream_servers, policy_server, tokenizer
) -> None:
    """OpenEnv's connect4_env as its repository has it (meta-pytorch/OpenEnv@685de41): the action is
    a column (an int), its server takes one session. Before: 1 of 4 (CAPACITY_REACHED,
    ConnectionClosedOK) and no action but by a parse of one's own."""
    environment = (
        "connect4_env.server.connect4_environment:Connect4Environment"
        if mode == "in process"
        else upstream_servers("connect4_env")
    )
    group = collect(
        served_upstream.url,
        {"environment": environment, "group_size": 4, "max_tokens": 12, "max_turns": 3},
        policy_server,
        tokenizer,
    )
    assert len(group.sequences) == 4 and not group.extras.get("rollout_errors"), group.extras
    assert all('"column"' in sequence.messages[0]["content"] for sequence in group.sequences)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["in process", "its own server"])
def test_upstream_echo_env_an_mcp_environment_runs_its_tool_calls(
    mode, served_upstream, upstream_servers, policy_server, tokenizer
) -> None:
    """echo_env is an MCP environment now (CallToolAction): the policy is shown its tools and its
    reply is read as a tool call. Before: the rollout was cancelled."""
    environment = (
        "echo_env.server.echo_environment:EchoEnvironment" if mode == "in process" else upstream_servers("echo_env")
    )
    group = collect(
        served_upstream.url,
        {"environment": environment, "group_size": 2, "max_tokens": 12, "max_turns": 2},
        policy_server,
        tokenizer,
    )
    assert len(group.sequences) == 2 and not group.extras.get("rollout_errors"), group.extras
    for sequence in group.sequences:
        assert '"tool_name"' in sequence.messages[0]["content"]  # the system message: the tool call's schema
        assert (
            "- echo_message(" in sequence.messages[1]["content"]
            and "- echo_with_length(" in sequence.messages[1]["content"]
        )


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["in process", "its own server"])
def test_upstream_grid_world_runs_unchanged_on_the_python_it_asks_for(
    mode, served_upstream, upstream_servers, policy_server, tokenizer
) -> None:
    """OpenEnv's grid_world_env as its repository has it: its action is an enum field
    (GridWorldAction.action: UP/DOWN/LEFT/RIGHT) and its pyproject asks for Python >= 3.12, which the
    adapter's venv (3.11) is not, so --requirements builds it a venv on a Python that is. Before:
    0 of 2 (`ValidationError: 2 validation errors for GridWorldAction`), and no way to install it."""
    environment = (
        "grid_world_env.server.grid_world_environment:GridWorldEnvironment"
        if mode == "in process"
        else upstream_servers("grid_world_env")
    )
    group = collect(
        served_upstream.url,
        {"environment": environment, "group_size": 4, "max_tokens": 12, "max_turns": 3},
        policy_server,
        tokenizer,
    )
    assert len(group.sequences) == 4 and not group.extras.get("rollout_errors"), group.extras
    assert all(
        '"action"' in sequence.messages[0]["content"] and "RIGHT" in sequence.messages[0]["content"]
        for sequence in group.sequences
    )
    python = subprocess.run(
        [str(upstream_layer()), "-c", "import sys; print(sys.version_info[:2] >= (3, 12))"],
        capture_output=True,
        text=True,
    )
    assert python.stdout.strip() == "True", python

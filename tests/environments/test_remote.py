"""Remote environments: `clotho env serve` in its own process, used by URL like a local environment
(conformance, config errors named by the service, a dead service failing groups as data)."""

from __future__ import annotations

import asyncio

import pytest

from core.scored_group import ScoredGroup
from environments.base import RolloutFailure
from environments.conformance import run_checks
from environments.loading import EnvironmentLoadError, load_config, load_environment_class
from environments.remote import RemoteEnvironment, remote_environment_class
from environments.testing import serve_environment
from inference.client import PolicyClient
from inference.server import free_port


@pytest.fixture(scope="module")
def served_arithmetic():
    served = serve_environment("arithmetic")
    yield served
    served.stop()


def test_a_url_loads_as_the_environment_it_serves_and_the_service_checks_its_config(served_arithmetic) -> None:
    env_class = load_environment_class(served_arithmetic.url)
    assert issubclass(env_class, RemoteEnvironment) and env_class.name == "arithmetic"
    config = load_config(env_class, {"group_size": 3, "max_operand": 5})
    assert config.group_size == 3 and config.model_dump()["max_operand"] == 5  # the served config, whole
    assert config.model_dump()["operations"]  # defaults filled in by the service
    with pytest.raises(EnvironmentLoadError) as error:
        load_config(env_class, {"group_size": 0, "max_operandd": 5})
    message = str(error.value)
    assert "group_size: Input should be greater than or equal to 1" in message and "max_operandd" in message
    assert "fields of ArithmeticConfig" in message and f"served by {served_arithmetic.url}" in message


def test_a_url_nobody_serves_is_a_load_error_saying_how_to_start_one() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EnvironmentLoadError, match=r"is it running\? start it with `clotho env serve NAME"):
        remote_environment_class(url)


@pytest.mark.integration
def test_a_served_environment_passes_the_conformance_suite_by_url(
    served_arithmetic, policy_server, policy_tokenizer
) -> None:
    results = asyncio.run(
        run_checks(
            load_environment_class(served_arithmetic.url),
            {"group_size": 3, "max_tokens": 8},
            server_url=policy_server.base_url,
            tokenizer=policy_tokenizer,
            api_key=getattr(policy_server, "api_key", None),
        )
    )
    assert [(r.name, r.status) for r in results if r.status != "passed"] == []


@pytest.mark.integration
def test_a_killed_service_fails_the_group_as_data_naming_it(policy_server, policy_tokenizer) -> None:
    served = serve_environment("arithmetic")
    env_class = load_environment_class(served.url)

    async def run() -> tuple[ScoredGroup | RolloutFailure, RolloutFailure]:
        async with PolicyClient(policy_server.base_url, api_key=getattr(policy_server, "api_key", None)) as client:
            env = env_class(
                load_config(env_class, {"group_size": 2, "max_tokens": 4}), client=client, tokenizer=policy_tokenizer
            )
            await env.setup()
            item = await env.get_item()
            first = await env.sample_group(item)
            served.process.kill()
            served.process.wait()
            second = await env.sample_group(item)
            await env.aclose()
            return first, second

    try:
        first, second = asyncio.run(run())
    finally:
        served.stop()
    assert isinstance(first, ScoredGroup) and first.env == "arithmetic" and len(first.sequences) == 2
    assert isinstance(second, RolloutFailure) and served.url in second.error and "is it running" in second.error

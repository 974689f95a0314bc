"""Atropos environments as they are in Atropos's own repository (tests/data/upstream: unchanged
copies), served by the adapter from .venv-env-atropos by file path, as a user who cloned Atropos
would point clotho at them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interop.conftest import rollout_groups, serve_adapter

ADAPTER = "environments.adapters.atropos:Atropos"
UPSTREAM = Path(__file__).resolve().parents[1] / "data" / "upstream" / "atropos" / "environments"
# Each environment's file, what `clotho env serve` adds for it, clotho's settings beyond group_size,
# and how many of 4 groups at least are stored.
# - gym_taxi makes Taxi-v3, which gymnasium 1.3 removed (the adapter's lock has 1.4), so it is served
#   with its own gymnasium. It asks for replies that fill its max_token_length (the stand-in's 2048)
#   and stores them re-tokenized from text: the stand-in's random ids decode to text that re-encodes
#   into ~1.5x as many tokens, and a full-length reply no longer fits the context to be scored
#   (too-large). max_tokens 64 caps a turn as a user caps a model's replies; an episode that goes on
#   to a second turn is still too large for a 2048-token context (its first prompt is ~1730 tokens).
#   It reads a reply's action as `content.strip().replace(".", "")[-1]`, which raises IndexError on a
#   reply with nothing else in it (the stand-in's sometimes is): the environment's own error, as it
#   would be under Atropos, recorded as an exception with its message.
# - blackjack and regex: the stand-in's answers mostly all score the same, and Atropos drops such
#   groups itself (dropped-by-environment), so none need be stored.
ENVIRONMENTS = {
    "gym_taxi": (
        "game_environments/gymnasium/gym_taxi.py:GymTaxiEnv",
        ("--with", "gymnasium<1.3"),
        {"max_tokens": 64},
        1,
        ("IndexError: string index out of range",),
    ),
    "blackjack": (
        "game_environments/gymnasium/blackjack/blackjack_env_no_thinking.py:BlackjackEnvNoThinking",
        (),
        {},
        0,
        (),
    ),
    "regex": ("community/regex_generation/regex_env.py:RegexEnv", (), {}, 0, ()),  # imports its sibling regex_problems
}


@pytest.fixture(scope="module")
def served():
    """The adapter served once per set of options."""
    services = {}

    def serve(options: tuple[str, ...]):
        if options not in services:
            services[options] = serve_adapter("atropos", ADAPTER, options)
        return services[options]

    yield serve
    for service in services.values():
        service.stop()


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_an_upstream_atropos_environment_runs_unchanged_from_its_file(
    name, served, prefect_server, policy_server, policy_tokenizer, tmp_path
) -> None:
    path, options, settings, stored, its_own_errors = ENVIRONMENTS[name]
    config = {"env": str(UPSTREAM / path), "group_size": 2, **settings}  # the environment's own settings otherwise
    summary, groups = rollout_groups(
        prefect_server,
        policy_server,
        policy_tokenizer,
        served(options).url,
        config,
        f"file://{tmp_path}/store/{name}",
        groups=4,
        concurrency=2,
    )
    [row] = summary["environments"]
    print(name, summary["totals"], row.get("failures by reason"))
    # Every item is a stored group or an outcome of the environment's own making, never an error
    # of the adapter's: Atropos drops a group whose scores are all equal (the tiny stand-in model's
    # answers mostly all score the same), a conversation the environment re-tokenizes into more
    # tokens than the stand-in's 2048-token context is too large to score or train, and an error
    # the environment's own code raises on the stand-in's reply is its own (the service's log says
    # which: each failed item is logged with its error).
    totals = summary["totals"]
    assert totals["groups"] + totals["failures"] == 4, summary
    assert set(totals["failures_by_reason"]) <= {"dropped-by-environment", "too-large", "exception"}, summary
    raised = [line for line in served(options).log_path.read_text().splitlines() if "failed (exception)" in line]
    assert len(raised) >= totals["failures_by_reason"].get("exception", 0)
    assert all(any(error in line for error in its_own_errors) for line in raised), raised
    assert len(groups) == totals["groups"] >= stored and all(not group.extras.get("rollout_errors") for group in groups)

"""Failures as data: whose they are (an environment's own choice to drop a group) and what a
failed run-time download tried to fetch."""

from __future__ import annotations

from environments.base import DroppedByEnvironment, RolloutFailure


def test_a_failed_run_time_download_is_named_with_what_it_tried_to_fetch() -> None:
    from urllib.error import URLError

    from environments.failures import fetch_failed, run_time_fetch

    nltk = LookupError("\n****\n  Resource \x1b[93mwords\x1b[0m not found.\n  Please use the NLTK Downloader\n")
    assert run_time_fetch(LookupError("  Resource 'words' not found.\n")).startswith("NLTK's 'words' data")
    assert run_time_fetch(nltk).endswith("python -m nltk.downloader words)")  # older NLTK colours the name
    try:
        try:
            raise URLError("no validated address for host 'raw.githubusercontent.com'")
        except URLError as cause:
            raise RuntimeError("could not load the dataset") from cause
    except RuntimeError as chained:
        assert "raw.githubusercontent.com" in run_time_fetch(chained)
        assert fetch_failed("environment x setup", chained).startswith(
            "environment x setup: it downloads data at run time"
        )
    assert run_time_fetch(KeyError("answer")) is None and fetch_failed("x", ValueError("bad")) is None


def test_a_group_the_environment_chose_to_drop_has_its_own_reason() -> None:
    assert (
        RolloutFailure.of("atropos", "i", DroppedByEnvironment("all scores equal")).reason == "dropped-by-environment"
    )
    assert RolloutFailure.of("atropos", "i", RuntimeError("a bug")).reason == "exception"

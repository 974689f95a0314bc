"""The suite's session fixtures (the tiny model, one live vLLM-CPU server) come from clotho's own
pytest plugin, environments.testing, which every installed clotho provides; re-exported here for
the tests that build models of their own."""

from environments.testing import CACHE, cached_tiny_model  # noqa: F401

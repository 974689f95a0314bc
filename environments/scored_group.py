"""The ScoredGroup contract under the name environment authors used before it moved to core
(core.scored_group, where every part of clotho can import it): the same objects, so an environment
written against `environments.scored_group` keeps working unchanged."""

from core.scored_group import (  # noqa: F401 - re-exported
    CONTRACT_REASONS,
    FINISH_REASONS,
    PER_TOKEN_OPTIONAL,
    SCHEMA_VERSION,
    InvalidGroupError,
    Objective,
    ScoredGroup,
    ScoredSequence,
    new_group_id,
    objective_problems,
    preference_pair,
)

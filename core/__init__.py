"""The bottom of the house: what every part of clotho imports and what imports no other clotho package.

- core.scored_group: the ScoredGroup contract environments return and everything else reads;
- core.overrides: the one `--set key.path=value` grammar of every command and config;
- core.validation: how a pydantic validation error reads, one line naming each field.

Above it, in the order imports may point (tests/test_import_direction.py keeps it): storage,
inference, environments, trainer, tasks, flows, then the clotho command line on top.
"""

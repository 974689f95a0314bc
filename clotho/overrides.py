"""The one `--set key.path=value` grammar of every command and config: dotted keys, YAML values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `dotted.key=value` set; values are YAML (8, 1e-6, true, null, [a, b])."""
    result = _deep_copy(data)
    for override in overrides:
        key, separator, raw = override.partition("=")
        if not separator or not key.strip():
            raise ValueError(f"--set {override!r}: write it as key.path=value, e.g. --set loss.name=dapo or --set group_size=8")
        parts = key.strip().split(".")
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ValueError(f"--set {override!r}: {where} is a value, not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            raise ValueError(f"--set {override!r}: the value is not YAML ({error}); quote strings that look like YAML") from None
    return result


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}

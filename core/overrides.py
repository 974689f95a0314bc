"""The one `--set key.path=value` grammar of every command and config: dotted keys, YAML values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `dotted.key=value` set; values are YAML (8, 1e-6, true, null, [a, b]).
    A number in the path indexes a list that is already there: `phases.1.steps=50`."""
    result = _deep_copy(data)
    for override in overrides:
        key, separator, raw = override.partition("=")
        if not separator or not key.strip():
            raise ValueError(
                f"--set {override!r}: write it as key.path=value, e.g. --set loss.name=dapo or --set group_size=8"
            )
        parts = key.strip().split(".")
        node: Any = result
        index: str | int = ""
        for depth, part in enumerate(parts):
            where = ".".join(parts[: depth + 1])
            index = part
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ValueError(
                        f"--set {override!r}: {where}: index a list of {len(node)} with 0..{len(node) - 1}"
                    )
                index = int(part)
            elif not isinstance(node, dict):
                raise ValueError(f"--set {override!r}: {'.'.join(parts[:depth])} is a value, not a section")
            if depth == len(parts) - 1:
                break
            if isinstance(node, dict):
                node = node.setdefault(index, {})
            else:
                node = node[index]
        try:
            node[index] = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            raise ValueError(
                f"--set {override!r}: the value is not YAML ({error}); quote strings that look like YAML"
            ) from None
    return result


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data

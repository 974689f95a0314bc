"""Prefect artifacts of a run: keys (the UI groups an artifact's versions by key, and keys take
lowercase letters, digits and dashes only), and cards, artifacts a run keeps current in place."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any, Literal
from uuid import UUID

Content = str | list[dict[str, Any]]  # markdown, or a table's rows


def artifact_key(kind: str, run: str) -> str:
    """'{kind}-{run}' with every other character run replaced by a dash: artifact_key('train', 'My_Run')
    is 'train-my-run'."""
    return f"{kind}-" + re.sub(r"[^a-z0-9-]+", "-", run.lower())


async def update_artifact_data(artifact_id: UUID, data: str) -> None:
    """Replaces an artifact's data in place (Prefect's artifact update): the UI shows the new content
    on the same card, where creating one under the same key would add a version."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    async with get_client() as client:
        await client.update_artifact(artifact_id, ArtifactUpdate(data=data))


class Card:
    """One markdown or table artifact a run keeps current: created on the first show(), then its
    data replaced in place, at most every `interval_s` unless forced (each update is an API call).
    Given a function, show() calls it only when an update is due: callers on a hot path (a group
    stored, the pipeline's 1 s watch) do not build content that would be dropped."""

    def __init__(self, kind: Literal["markdown", "table"], key: str, description: str, interval_s: float = 0.0):
        self.kind, self.key, self.description, self.interval_s = kind, key, description, interval_s
        self.artifact_id: UUID | None = None
        self._last = 0.0
        self._lock = asyncio.Lock()  # concurrent callers (a flow's group tasks): one creates it, in order

    async def show(self, content: Content | Callable[[], Content], force: bool = False) -> None:
        from prefect.artifacts import TableArtifact, acreate_markdown_artifact, acreate_table_artifact

        async with self._lock:
            if self.artifact_id is not None and not force and time.monotonic() - self._last < self.interval_s:
                return
            if callable(content):
                content = content()
            if self.artifact_id is None:
                create = acreate_markdown_artifact if self.kind == "markdown" else acreate_table_artifact
                self.artifact_id = await create(content, key=self.key, description=self.description)
            else:
                data = content if self.kind == "markdown" else await TableArtifact(table=content).aformat()
                await update_artifact_data(self.artifact_id, data)
            self._last = time.monotonic()

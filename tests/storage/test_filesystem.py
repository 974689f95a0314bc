"""Storage errors name the URL and the fix."""

from __future__ import annotations

import pytest

from storage.filesystem import publish, resolve
from storage.reader import ShardReader


def test_publish_takes_paths_not_urls(tmp_path) -> None:
    fs, path = resolve(f"file://{tmp_path}/x.parquet")
    with pytest.raises(ValueError, match="filesystem paths, not URLs"):
        publish(fs, f"file://{path}", b"data", str(tmp_path / "_tmp"))


def test_empty_url_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        resolve("")


@pytest.mark.integration
def test_missing_s3_credentials_name_the_fix(s3_server, monkeypatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookups
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    reader = ShardReader(
        "s3://clotho-test/creds",
        "run",
        storage_options={"endpoint_url": s3_server.endpoint_url, "skip_instance_cache": True},
    )
    with pytest.raises(PermissionError, match="s3://clotho-test/creds/run/rollouts: no usable S3 credentials"):
        reader.new_shards()

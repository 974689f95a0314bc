"""Where a run's data lives under a storage root: names, URLs and Hive partitions."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

ROLLOUTS = "rollouts"
# Kept beside rollouts/ rather than inside it: DuckDB and Polars globs do not skip '_' or '.' names.
QUARANTINE = "_quarantine"
TEMPORARY = "_tmp"
SHARD_SUFFIX = ".parquet"

# Env names become a directory `env=NAME`; keep them to characters every store and reader accepts.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_SHARD_ID = re.compile(r"\d{8}T\d{6}\.\d{9}Z-[0-9a-f]{12}")


@dataclass(frozen=True)
class ShardLocation:
    """The partition and id of a shard, parsed from its path under `{root}/{run}/rollouts/`."""

    env: str
    policy_version: int
    shard_id: str

    @property
    def name(self) -> str:
        """Path relative to the rollouts directory: the shard's identity in ledgers and logs."""
        return f"{partition_path(self.env, self.policy_version)}/{self.shard_id}{SHARD_SUFFIX}"


def check_env_name(env: str) -> str:
    """Return env if it can be a Hive partition value, else raise ValueError saying how to fix it."""
    return _checked_name(env, f"env name {env!r} cannot be a partition directory")


def check_run_name(run: str) -> str:
    """Return run if it is a single path segment, else raise ValueError saying how to fix it."""
    return _checked_name(run, f"run name {run!r} must be one path segment")


def _checked_name(name: str, problem: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{problem}: use 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit")
    return name


def split_run_url(url: str) -> tuple[str, str]:
    """'s3://bucket/prefix/myrun' -> ('s3://bucket/prefix', 'myrun'): the storage root and the run.

    A run is named by this one URL everywhere (`--run` of every command, `run_url` of every flow)."""
    root, _, run = url.rstrip("/").rpartition("/")
    if not root or root.endswith(":/") or root.endswith(":"):
        raise ValueError(
            f"{url!r} is not STORAGE_URL/RUN; give the run's URL, e.g. file:///data/runs/myrun, "
            "s3://bucket/runs/myrun or .clotho/storage/myrun"
        )
    return root, check_run_name(run)


def check_policy_version(policy_version: int) -> int:
    """Return policy_version if it is a non-negative int, else raise ValueError."""
    if isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0:
        raise ValueError(f"policy_version {policy_version!r} must be an int >= 0")
    return policy_version


def join(url: str, *parts: str) -> str:
    """Join path segments onto a URL or local path with '/', whatever the protocol."""
    return "/".join([url.rstrip("/"), *(part.strip("/") for part in parts)])


def run_url(root: str, run: str) -> str:
    return join(root, check_run_name(run))


def rollouts_url(root: str, run: str) -> str:
    """`{root}/{run}/rollouts`: a Hive-partitioned Parquet dataset DuckDB, Polars or Spark can read."""
    return join(run_url(root, run), ROLLOUTS)


def partition_path(env: str, policy_version: int) -> str:
    return f"env={check_env_name(env)}/policy_version={check_policy_version(policy_version)}"


def shard_url(root: str, run: str, env: str, policy_version: int, shard_id: str) -> str:
    """`{root}/{run}/rollouts/env={env}/policy_version={v}/{shard_id}.parquet`."""
    location = ShardLocation(env, policy_version, check_shard_id(shard_id))
    return join(rollouts_url(root, run), location.name)


def new_shard_id(time_ns: int | None = None) -> str:
    """A unique id that sorts by creation time and reads as UTC: `20250101T120000.000000001Z-<hex>`."""
    now = time.time_ns() if time_ns is None else time_ns
    seconds, nanoseconds = divmod(now, 1_000_000_000)
    stamp = datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}.{nanoseconds:09d}Z-{os.urandom(6).hex()}"


def check_shard_id(shard_id: str) -> str:
    if not isinstance(shard_id, str) or not _SHARD_ID.fullmatch(shard_id):
        raise ValueError(
            f"shard id {shard_id!r} is not of the form made by new_shard_id(), "
            "e.g. '20250101T120000.000000001Z-0123456789ab'"
        )
    return shard_id


def is_hidden(relative_path: str) -> bool:
    """True for paths readers must skip: any segment starting with '_' or '.' (temp files, quarantine)."""
    return any(part.startswith(("_", ".")) for part in relative_path.split("/") if part)


def parse_shard_name(name: str) -> ShardLocation | None:
    """Parse `env=E/policy_version=V/ID.parquet`; None when the path is not a clotho shard."""
    parts = name.strip("/").split("/")
    if len(parts) != 3 or not parts[2].endswith(SHARD_SUFFIX):
        return None
    env_part, version_part, file_name = parts
    if not env_part.startswith("env=") or not version_part.startswith("policy_version="):
        return None
    env = env_part.removeprefix("env=")
    version = version_part.removeprefix("policy_version=")
    shard_id = file_name.removesuffix(SHARD_SUFFIX)
    if not _NAME.fullmatch(env) or not version.isdigit() or not _SHARD_ID.fullmatch(shard_id):
        return None
    return ShardLocation(env, int(version), shard_id)

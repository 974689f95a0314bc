"""fsspec access for storage: resolve URLs, publish files atomically, list and read, clear errors."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


def resolve(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and protocol-less path of a URL (file://, s3://, memory://, a plain path, ...).

    `storage_options` go to the filesystem (for s3fs: key, secret, endpoint_url, ...). Without them
    s3fs follows the AWS variables, AWS_ENDPOINT_URL included, which points every process of a run at
    MinIO or another S3-compatible server.
    """
    if not isinstance(url, str) or not url:
        raise ValueError(
            f"storage URL {url!r} must be a non-empty string such as 's3://bucket/runs'"
        )
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as error:
        raise ImportError(
            f"{url}: no fsspec filesystem for this protocol is installed ({error}); "
            "install its package, e.g. s3fs for s3://, gcsfs for gs://"
        ) from error


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Re-raise storage failures as FileNotFoundError / PermissionError / OSError naming the URL."""
    try:
        yield
    except (FileNotFoundError, PermissionError, FileExistsError) as error:
        if url in str(error):
            raise
        raise type(error)(f"{url}: {error}") from error
    except Exception as error:  # botocore's credential errors are not OSErrors; name the fix
        if isinstance(error, _credential_errors()):
            raise PermissionError(
                f"{url}: no usable S3 credentials ({error}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY or pass storage_options={'key': ..., 'secret': ...}"
            ) from error
        raise


def _credential_errors() -> tuple[type[Exception], ...]:
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError
    except ImportError:  # no S3 support installed, so no S3 credential errors either
        return ()
    return NoCredentialsError, PartialCredentialsError


def publish(
    fs: fsspec.AbstractFileSystem, path: str, data: bytes | memoryview, temp_dir: str
) -> None:
    """Make `data` appear at `path` all at once, never replacing an existing file.

    Local disks: write a file in `temp_dir` (same file system, outside the dataset), then hard-link it
    to `path`; the link fails if `path` exists, so two writers can never clobber each other.
    Object stores and memory://: one exclusive PUT of the whole object (fsspec's mode="create"; on S3
    a conditional `If-None-Match: *` write), which is atomic there.
    """
    if "://" in path or "://" in temp_dir:
        raise ValueError(
            f"publish takes filesystem paths, not URLs: {path}, {temp_dir}; see resolve()"
        )
    try:
        if is_local(fs):
            _publish_local(path, data, temp_dir)
        else:
            fs.pipe_file(path, bytes(data) if isinstance(data, memoryview) else data, mode="create")
    except FileExistsError:
        raise FileExistsError(f"{path} already exists; shards are never overwritten") from None


def _publish_local(path: str, data: bytes | memoryview, temp_dir: str) -> None:
    os.makedirs(temp_dir, exist_ok=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temp_path = os.path.join(temp_dir, f".{os.path.basename(path)}.{os.urandom(4).hex()}.tmp")
    try:
        with open(temp_path, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(
                file.fileno()
            )  # the name must never point at bytes still in flight after a crash
        try:
            os.link(temp_path, path)
        except FileExistsError:
            raise
        except OSError:  # file systems without hard links: rename is atomic, only not exclusive
            if os.path.exists(path):
                raise FileExistsError(path) from None
            os.rename(temp_path, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_path)


def list_files(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, int]:
    """Every file below `path` with its size in bytes; {} when `path` does not exist yet."""
    fs.invalidate_cache(path)  # s3fs caches listings; new shards must show up on the next poll
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    return {
        name: int(info.get("size") or 0)
        for name, info in found.items()
        if info.get("type") != "directory"
    }


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """The whole file in one request: shards are small enough, and one GET beats many range reads."""
    return fs.cat_file(path)


def relative(path: str, base: str) -> str:
    """`path` relative to `base`, both protocol-less as fsspec returns them."""
    base = base.rstrip("/")
    if not path.startswith(base + "/"):
        raise ValueError(f"{path} is not below {base}")
    return path[len(base) + 1 :]

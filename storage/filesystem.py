"""fsspec access for storage: resolve URLs, publish files atomically, list and read, clear errors."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import fsspec
import tenacity
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from core.retrying import attempts

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long an operation on an object store is retried before it fails (seconds); the variable
# lets a run wait out a longer outage (an S3-compatible server restarting, say).
RETRY_S_VARIABLE = "CLOTHO_STORAGE_RETRY_S"
DEFAULT_RETRY_S = 60.0
# Backoff between clotho's tries: doubling from FIRST, at most MAX, each drawn from [d/2, d] so
# that many writers hit by the same outage do not retry in step, yet every wait has a floor.
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
# Each of clotho's tries is one botocore call, which retries a lone failed request itself (3
# requests in all, "standard" mode: 5xx, throttling, refused or dropped connections, timeouts;
# jittered). s3fs retries dropped connections, torn bodies and timeouts around that again (5 times
# by default), and aiohttp resends an idempotent request once when a kept-alive connection drops:
# with s3fs at 2, a server that drops every request costs 3 x 2 x 2 requests per try, one that
# hangs as many read timeouts (s3fs: 15 s).
S3_REQUEST_RETRIES = {"mode": "standard", "total_max_attempts": 3}
S3FS_RETRIES = 2
_REMOTE_ERRNOS = {
    errno.EIO,
    errno.EBUSY,
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
    getattr(errno, "EREMOTEIO", errno.EIO),
}


class StorageUnavailableError(OSError):
    """An object store kept failing (5xx, refused or dropped connections, timeouts) past the retry
    budget. Nothing partial is visible: the operation can be run again once the store is back."""

    def __init__(self, message: str, last_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.last_error = last_error


def resolve(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and protocol-less path of a URL (file://, s3://, memory://, a plain path, ...).

    `storage_options` go to the filesystem (for s3fs: key, secret, endpoint_url, ...). Without them
    s3fs follows the AWS variables, AWS_ENDPOINT_URL included, which points every process of a run at
    MinIO or another S3-compatible server.

    A remote filesystem gets no listings cache: the files of a run are written by other processes,
    and s3fs answers `info`, `exists` and even `cat_file` (which asks the size first) from a cached
    listing of the directory, so a shard written after its partition was listed was "not found"
    without a request for as long as the process lived.
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"storage URL {url!r} must be a non-empty string such as 's3://bucket/runs'")
    try:
        options = dict(storage_options or {})
        if _is_remote_class(fsspec.get_filesystem_class(fsspec.core.split_protocol(url)[0] or "file")):
            options["use_listings_cache"] = False
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as error:
        raise ImportError(
            f"{url}: no fsspec filesystem for this protocol is installed ({error}); "
            "install its package, e.g. s3fs for s3://, gcsfs for gs://"
        ) from error
    if "s3" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol):
        _add_s3_retries(fs)
    return fs, path


def _add_s3_retries(fs: fsspec.AbstractFileSystem) -> None:
    """Give an s3fs filesystem clotho's request retries, unless they are set already (its
    config_kwargs' "retries", or botocore's AWS_MAX_ATTEMPTS / AWS_RETRY_MODE). Set on the instance
    (fsspec shares one per set of options) before its first request creates the client; an
    instance that was used before keeps the retries its client was made with."""
    if "retries" in fs.config_kwargs or os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE"):
        return
    fs.config_kwargs = {**fs.config_kwargs, "retries": dict(S3_REQUEST_RETRIES)}
    fs.retries = S3FS_RETRIES


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def is_remote(fs: fsspec.AbstractFileSystem) -> bool:
    """An object store or other network filesystem: its failures may pass, so they are retried."""
    return _is_remote_class(type(fs))


def _is_remote_class(cls: type) -> bool:
    return not issubclass(cls, (LocalFileSystem, MemoryFileSystem))


def is_transient(error: BaseException) -> bool:
    """Whether a remote filesystem's error may pass if tried again: 5xx answers (s3fs makes them
    OSErrors with EREMOTEIO, EBUSY or EIO), refused or dropped connections, timeouts. Missing
    files, existing files, refused permissions and bad requests are answers, not faults."""
    if isinstance(error, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(error, (TimeoutError, ConnectionError)):
        return True
    if isinstance(error, OSError):
        return error.errno in _REMOTE_ERRNOS
    return isinstance(error, _connection_errors())


def _connection_errors() -> tuple[type[Exception], ...]:
    errors: tuple[type[Exception], ...] = ()
    with contextlib.suppress(ImportError):
        from botocore.exceptions import ConnectionError as BotocoreConnectionError
        from botocore.exceptions import HTTPClientError

        errors += (BotocoreConnectionError, HTTPClientError)
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError

        errors += (ClientError,)
    return errors


def retry_budget_s() -> float:
    value = os.environ.get(RETRY_S_VARIABLE, "")
    try:
        budget = float(value) if value else DEFAULT_RETRY_S
    except ValueError:
        budget = -1.0
    if budget < 0:
        raise ValueError(f"{RETRY_S_VARIABLE}={value!r}: use the seconds to retry storage for, e.g. 60")
    return budget


def retrying(fs: fsspec.AbstractFileSystem, path: str, operation: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`operation(*args, **kwargs)`, tried again with backoff while a remote filesystem fails
    transiently, for up to CLOTHO_STORAGE_RETRY_S seconds; then one StorageUnavailableError naming
    the URL and the fix. Local and memory filesystems run it once. The operation must be safe to
    repeat (see publish for the one write that is not by itself)."""
    if not is_remote(fs):
        return operation(*args, **kwargs)
    budget = retry_budget_s()

    def give_up(state: tenacity.RetryCallState) -> NoReturn:
        # One error, its chain cut: the last failure is in the message and .last_error.
        error = state.outcome.exception() if state.outcome is not None else None  # given up on an error: never None
        last = error if error is not None else RuntimeError("no error recorded")
        raise unavailable(fs, path, last, state.attempt_number, state.seconds_since_start, budget) from None

    for attempt in attempts(
        retry_on=is_transient,
        first_s=FIRST_BACKOFF_S,
        max_s=MAX_BACKOFF_S,
        budget_s=budget,
        what=f"{_url(fs, path)} (gives up after {budget:.0f} s)",
        on_give_up=give_up,
        logger=log,
    ):
        with attempt:
            return operation(*args, **kwargs)
    raise AssertionError("unreachable: the policy returns or raises")


def unavailable(
    fs: fsspec.AbstractFileSystem | None,
    where: str,
    error: BaseException,
    attempts: int | None = None,
    elapsed: float | None = None,
    budget: float | None = None,
) -> StorageUnavailableError:
    """The one error for a store that kept failing: the URL, what went wrong, the fix."""
    url = _url(fs, where) if fs is not None else where
    tried = f" after {attempts} tries over {elapsed:.1f} s" if attempts is not None and elapsed is not None else ""
    endpoint = _endpoint(fs) if url.startswith(("s3://", "s3a://")) else ""
    longer = f"; set {RETRY_S_VARIABLE} to retry longer than {budget:.0f} s" if budget is not None else ""
    return StorageUnavailableError(
        f"{url}: storage unavailable{tried} ({_summary(error)}); check that the storage"
        f"{f' at {endpoint}' if endpoint else ''} is up and reachable, then run again{longer}",
        error,
    )


def _url(fs: fsspec.AbstractFileSystem | None, path: str) -> str:
    if fs is None or "://" in path:
        return path
    return fs.unstrip_protocol(path)


def _endpoint(fs: fsspec.AbstractFileSystem | None) -> str:
    endpoint = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    return endpoint or os.environ.get("AWS_ENDPOINT_URL", "")


def _summary(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Re-raise storage failures as FileNotFoundError / PermissionError / OSError naming the URL."""
    try:
        yield
    except StorageUnavailableError:
        raise  # names its URL and the fix already
    except (FileNotFoundError, PermissionError, FileExistsError) as error:
        if url in str(error):
            raise
        raise type(error)(f"{url}: {error}") from error
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"{url}: no space left on device; free space on that disk or point the storage root at another one",
            ) from None
        if url in str(error):
            raise
        if is_transient(error):  # from a call that retrying() does not wrap
            raise unavailable(None, url, error) from None
        try:
            renamed = type(error)(error.errno, f"{url}: {error.strerror or error}")
        except TypeError:
            renamed = OSError(error.errno, f"{url}: {error.strerror or error}")
        raise renamed from error
    except Exception as error:  # botocore's errors are not OSErrors; name the URL and the fix
        if isinstance(error, _credential_errors()):
            raise PermissionError(
                f"{url}: no usable S3 credentials ({error}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY or pass storage_options={'key': ..., 'secret': ...}"
            ) from error
        if is_transient(error):
            raise unavailable(None, url, error) from None
        raise


def _credential_errors() -> tuple[type[Exception], ...]:
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError
    except ImportError:  # no S3 support installed, so no S3 credential errors either
        return ()
    return NoCredentialsError, PartialCredentialsError


def publish(
    fs: fsspec.AbstractFileSystem,
    path: str,
    data: bytes | memoryview,
    temp_dir: str,
    before: Callable[[], None] | None = None,
) -> None:
    """Make `data` appear at `path` all at once, never replacing an existing file.

    Local disks: write a file in `temp_dir` (same file system, outside the dataset), then hard-link it
    to `path`; the link fails if `path` exists, so two writers can never clobber each other.
    Object stores and memory://: one exclusive PUT of the whole object (fsspec's mode="create"; on S3
    a conditional `If-None-Match: *` write), which is atomic there (on memory://, under a lock). Retried while the store fails
    transiently; a retry whose earlier try landed unanswered (the connection dropped after the
    store took the object) finds the object there: when it holds exactly `data`, the write is ours
    and done, else it is another writer's and FileExistsError stands.

    `before` runs once, when the bytes are staged (on a local disk: written and synced to the
    temporary file), just before they become visible: what must exist before the file does (its
    index entry) is then never left alone for longer than a link by a writer killed mid-write.
    """
    if "://" in path or "://" in temp_dir:
        raise ValueError(f"publish takes filesystem paths, not URLs: {path}, {temp_dir}; see resolve()")
    try:
        if is_local(fs):
            _publish_local(path, data, temp_dir, before)
        else:
            body = bytes(data) if isinstance(data, memoryview) else data
            if before is not None:
                before()
            try:
                with _MEMORY_CREATE if isinstance(fs, MemoryFileSystem) else contextlib.nullcontext():
                    retrying(fs, path, fs.pipe_file, path, body, mode="create")
            except FileExistsError:
                if not is_remote(fs) or retrying(fs, path, _stored_bytes, fs, path) != body:
                    raise
                log.info("%s: a retried write found its own earlier try stored", _url(fs, path))
    except FileExistsError:
        raise FileExistsError(f"{path} already exists; published files are never overwritten") from None


# memory://'s exclusive create checks, then stores: two threads could both pass the check.
_MEMORY_CREATE = threading.Lock()


def put_file(fs: fsspec.AbstractFileSystem, source: Path, target: str) -> None:
    """Copy the local file `source` to `target` (a path of `fs`), retried like every storage call. On a
    local disk a hard link where it can be (the same file system): a checkpoint's GBs are then not
    written a second time. A file already at `target` (a publish killed before its marker) is replaced."""
    if is_local(fs):
        with contextlib.suppress(FileNotFoundError):
            os.remove(target)
        try:
            os.link(source, target)
            return
        except OSError:  # another file system, or one without hard links: copy
            pass
    retrying(fs, target, fs.put_file, str(source), target)


def _stored_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes | None:
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def _publish_local(
    path: str, data: bytes | memoryview, temp_dir: str, before: Callable[[], None] | None = None
) -> None:
    os.makedirs(temp_dir, exist_ok=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temp_path = os.path.join(temp_dir, f".{os.path.basename(path)}.{os.urandom(4).hex()}.tmp")
    try:
        with open(temp_path, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())  # the name must never point at bytes still in flight after a crash
        if before is not None:
            before()
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
    try:
        found = retrying(fs, path, fs.find, path, detail=True)
    except FileNotFoundError:
        return {}
    return {name: int(info.get("size") or 0) for name, info in found.items() if info.get("type") != "directory"}


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """The whole file in one request: shards are small enough, and one GET beats many range reads."""
    return retrying(fs, path, fs.cat_file, path)


def relative(path: str, base: str) -> str:
    """`path` relative to `base`, both protocol-less as fsspec returns them."""
    base = base.rstrip("/")
    if not path.startswith(base + "/"):
        raise ValueError(f"{path} is not below {base}")
    return path[len(base) + 1 :]


def download_whole(
    url: str,
    fs: fsspec.AbstractFileSystem,
    root: str,
    names: Iterable[str],
    target: Path,
    *,
    written_last: dict[str, bytes] | None = None,
    build: Callable[[Path], None] | None = None,
) -> None:
    """The files `names` under `root` (the storage path of `url`) into the local directory `target`,
    whole or not at all: downloaded into a hidden directory beside it, `build` run on that directory
    (files made from the downloaded ones), `written_last` (marker files, name -> bytes) written there
    after them, then renamed into place. Where another process put a copy there first (several on
    one host, or hosts sharing a disk), that one is kept."""
    import shutil

    aside = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    with storage_errors(url):
        for name in names:
            (aside / name).parent.mkdir(parents=True, exist_ok=True)
            retrying(fs, f"{root.rstrip('/')}/{name}", fs.get_file, f"{root.rstrip('/')}/{name}", str(aside / name))
    aside.mkdir(parents=True, exist_ok=True)
    try:
        if build is not None:
            build(aside)
    except BaseException:
        shutil.rmtree(aside, ignore_errors=True)
        raise
    for name, body in (written_last or {}).items():
        (aside / name).write_bytes(body)
    try:
        os.rename(aside, target)
    except OSError:  # a copy got there first
        shutil.rmtree(aside, ignore_errors=True)

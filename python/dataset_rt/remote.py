"""Copying caches to and from object storage: ``push`` and ``pull``.

A remote root is a URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``file://``); cache
``name`` lives under ``<url>/<name>/`` with the same layout as on disk. ``push`` uploads
every file the manifest names, checking each against the manifest first, and the manifest
last, so a reader of the remote root never finds a cache whose files are not all there.
``pull`` downloads a remote cache into a hidden directory of the local root, checks every
file and record against the manifest, and publishes it under its name in one atomic step.

Storage goes through obstore, the Python binding of the Rust ``object_store`` crate that
Polars' own cloud readers use. ``storage_options`` take the keys Polars takes
(``aws_endpoint_url``, ``aws_access_key_id``, ``aws_secret_access_key``, ``aws_region``,
``aws_allow_http``, ...), and without them the standard environment variables and profiles
apply. A request that fails with a server error, a dropped connection or (when reading) a
timeout is retried with backoff for a few seconds, then raised as
:class:`~dataset_rt.errors.CacheIOError` naming the object.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from dataset_rt import _native, registry
from dataset_rt.caches import Cache
from dataset_rt.errors import (
    ArgumentError,
    CacheCorruptError,
    CacheIOError,
    CacheNotFoundError,
)
from dataset_rt.progress import BuildProgress
from dataset_rt.roots import PathLike, resolve_root

__all__ = ["is_url", "pull", "push"]

StorageOptions = Mapping[str, Any] | None
"""Options for the object store, with the keys Polars' cloud readers take."""

_SCHEMES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure", "file"}
# Keys object_store takes as HTTP client options rather than as the store's configuration,
# with or without a provider prefix (Polars passes both kinds in one dict).
_CLIENT_KEYS = {
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "default_content_type",
    "http1_only",
    "http2_only",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "timeout",
    "user_agent",
}
_PREFIXES = ("aws_", "google_", "azure_")
# Requests that fail with a 5xx, a dropped connection or (reads) a timeout are retried with
# exponential backoff and jitter, then raised: a few seconds of trying, not object_store's
# default of minutes.
_RETRY = {
    "max_retries": 5,
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=5),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=60),
}


def is_url(root: object) -> bool:
    """Whether ``root`` names object storage (``s3://...`` and the like), not a directory."""
    return isinstance(root, str) and urlparse(root).scheme in _SCHEMES


def _split_options(options: StorageOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for key, value in (options or {}).items():
        bare = key.lower()
        for prefix in _PREFIXES:
            bare = bare.removeprefix(prefix)
        if bare in _CLIENT_KEYS:
            client[bare] = value
        else:
            config[key] = value
    return config, client


class _Remote:
    """A cache's directory in object storage: ``<url>/<name>/``."""

    def __init__(self, url: str, name: str, options: StorageOptions) -> None:
        if not is_url(url):
            raise ArgumentError(
                f"{url!r} is not an object-storage URL; use s3://bucket/prefix, gs://, az:// "
                "or file://"
            )
        import obstore.store

        config, client = _split_options(options)
        self.url = f"{url.rstrip('/')}/{name}"
        # Typed per provider by obstore; the keys are the user's, checked by object_store.
        from_url: Any = obstore.store.from_url
        try:
            if urlparse(self.url).scheme == "file":  # a directory: no client, nothing to retry
                self.store = from_url(self.url, mkdir=True)
            else:
                self.store = from_url(
                    self.url, config=config, client_options=client, retry_config=_RETRY
                )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # obstore panics (a BaseException) on some bad options
            raise ArgumentError(f"cannot reach {self.url} with these options: {exc}") from None

    def where(self, path: str) -> str:
        return f"{self.url}/{path}"

    def error(self, path: str, exc: BaseException) -> Exception:
        """``exc`` from the object store, as the error of dataset_rt that says what failed."""
        import obstore.exceptions as oe

        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        where = self.where(path)
        if "NoSuchBucket" in str(exc) or "bucket does not exist" in str(exc).lower():
            bucket = urlparse(self.url).netloc
            return CacheIOError(f"bucket {bucket!r} does not exist (at {where})")
        if isinstance(exc, FileNotFoundError | oe.NotFoundError):
            return CacheNotFoundError(f"no object at {where}")
        if isinstance(exc, oe.UnauthenticatedError | oe.PermissionDeniedError):
            return CacheIOError(f"access to {where} was refused (credentials?): {text}")
        return CacheIOError(f"object storage failed on {where}: {text}")

    def get(self, path: str) -> bytes:
        import obstore

        try:
            return bytes(obstore.get(self.store, path).bytes())
        except Exception as exc:
            raise self.error(path, exc) from exc

    def download(self, path: str, target: Path) -> int:
        import obstore

        target.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        try:
            with target.open("wb") as out:
                for chunk in obstore.get(self.store, path).stream(min_chunk_size=8 << 20):
                    out.write(chunk)
                    written += len(chunk)
        except Exception as exc:
            raise self.error(path, exc) from exc
        return written

    def upload(self, path: str, source: Path) -> None:
        import obstore

        try:
            obstore.put(self.store, path, source)
        except Exception as exc:
            raise self.error(path, exc) from exc


# Transfers in flight at once: object stores serve many requests in parallel, and each
# one waits on the network more than on this machine (obstore releases the GIL).
_IN_FLIGHT = 8

T = TypeVar("T")


def _in_parallel(
    items: Sequence[T], transfer: Callable[[T], int], label: str, progress: bool
) -> None:
    """Runs ``transfer(item)`` for every item, ``_IN_FLIGHT`` at a time, with one progress line.

    ``transfer`` returns the bytes it moved. The first failure cancels what has not started
    and is raised.
    """
    moved = [0]
    bar = BuildProgress(label, nbytes=lambda: moved[0], enabled=progress, total=len(items))
    ok = False
    try:
        with ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix="drt-transfer") as pool:
            pending = [pool.submit(transfer, item) for item in items]
            try:
                for count, future in enumerate(as_completed(pending), 1):
                    moved[0] += future.result()
                    bar.update(count)
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
        bar.settle(len(items))
        ok = True
    finally:
        bar.close(ok=ok)


def push(
    name: str,
    url: str,
    *,
    root: PathLike | None = None,
    storage_options: StorageOptions = None,
    progress: bool = True,
) -> str:
    """Uploads local cache ``name`` to ``<url>/<name>/``; returns that URL.

    Each file the manifest names is checked against its recorded size and checksum before
    it is uploaded, and the manifest goes last: a remote reader sees the previous manifest
    (or none) until every file of the new one is in place. Pushing the same build again
    uploads it again; pushing another build of ``name`` over a remote one is refused,
    since readers of the remote cache would find its files replaced under them.

    Raises
    ------
    CacheNotFoundError
        No cache ``name`` under the local root.
    CacheCorruptError
        A local file does not match the manifest; nothing of the manifest is uploaded.
    CacheIOError
        The object store failed (the message names the object, and the bucket if missing).
    ArgumentError
        Another build of ``name`` is already there.
    """
    root_path = resolve_root(root)
    store = _native.Store(str(root_path))
    manifest = store.manifest(name)
    remote = _Remote(url, name, storage_options)
    existing = _remote_manifest(remote)
    remote_id = None if existing is None else existing[1].get("cache_id")
    if existing is not None and remote_id != manifest.cache_id:
        raise ArgumentError(
            f"{remote.url} holds another build of {name!r} (cache_id "
            f"{remote_id}, this one {manifest.cache_id}); push under another "
            "name, or remove the remote one first"
        )
    local = root_path / name

    def upload(entry: tuple[str, str | None]) -> int:
        file, checksum = entry
        _check_local(local / file, checksum)
        remote.upload(file, local / file)
        return (local / file).stat().st_size

    _in_parallel(manifest.files, upload, f"push {name}", progress)
    remote.upload("manifest.json", local / "manifest.json")
    return remote.url


def _check_local(path: Path, expected: str | None) -> None:
    """Refuses a local file whose checksum is not what the manifest records."""
    if expected is None:  # metadata of caches written before checksums were recorded
        return
    _, found = _native.file_checksum(path)
    if found != expected:
        raise CacheCorruptError(
            f"{path} does not match its manifest (checksum {found}, recorded {expected}); "
            "check the cache with `dataset-rt verify` before pushing it"
        )


def _remote_manifest(remote: _Remote) -> tuple[bytes, dict[str, Any]] | None:
    """The remote manifest as stored, and parsed; None if there is none."""
    try:
        raw = remote.get("manifest.json")
    except CacheNotFoundError:
        return None
    return raw, dict(json.loads(raw))


def pull(
    url: str,
    name: str,
    *,
    root: PathLike | None = None,
    storage_options: StorageOptions = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Cache:
    """Downloads cache ``name`` from ``<url>/<name>/`` into the local root; returns it.

    The files go into a hidden directory first; every file and record is then checked
    against the downloaded manifest, and only an intact, complete copy is published under
    ``name``, in one atomic step. A local cache of that name is kept if it is the same
    build (nothing is downloaded) and replaced only with ``overwrite=True`` otherwise.

    Raises
    ------
    CacheNotFoundError
        No cache ``name`` under ``url``.
    CacheCorruptError
        A downloaded file or record does not match the manifest; nothing is published.
    CacheIOError
        The object store failed (the message names the object, and the bucket if missing).
    ArgumentError
        Another build of ``name`` exists locally and ``overwrite`` is False.
    """
    root_path = resolve_root(root)
    root_path.mkdir(parents=True, exist_ok=True)
    remote = _Remote(url, name, storage_options)
    found = _remote_manifest(remote)
    if found is None:
        raise CacheNotFoundError(f"no cache {name!r} under {url} ({remote.where('manifest.json')})")
    raw, text = found
    store = _native.Store(str(root_path))
    with store.lock(name) as lock:
        if store.exists(name):
            local_id = store.manifest(name).cache_id
            if local_id == text.get("cache_id"):
                return Cache(registry.open_reader(root_path, name), root_path)
            if not overwrite:
                raise ArgumentError(
                    f"{root_path / name} holds another build of {name!r} (cache_id "
                    f"{local_id}, the remote one {text.get('cache_id')}); pass "
                    "overwrite=True to replace it"
                )
        copy = Path(store.begin_copy(lock))
        ok = False
        try:
            (copy / "manifest.json").write_bytes(raw)  # byte for byte, as pushed
            files = [file for file, _ in _native.read_manifest(copy).files]

            def download(file: str) -> int:
                return remote.download(file, copy / file)

            _in_parallel(files, download, f"pull {name}", progress)
            store.publish_copy(lock, copy)
            ok = True
        finally:
            if not ok:
                store.discard_copy(copy)
    return Cache(registry.open_reader(root_path, name), root_path)

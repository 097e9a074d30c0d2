"""Copying caches to and from object storage: ``push`` and ``pull``.

A remote root is a URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``file://``); cache
``name`` lives under ``<url>/<name>/`` with the same layout as on disk (``drt.open`` reads
one in place, through :mod:`dataset_rt.fetch`). ``push`` uploads every file the manifest
names, checking each against the manifest first, and the manifest last, so a reader of the
remote root never finds a cache whose files are not all there.
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

from pathlib import Path

from dataset_rt import _native, registry
from dataset_rt.caches import Cache
from dataset_rt.errors import (
    ArgumentError,
    CacheCorruptError,
    CacheNotFoundError,
)
from dataset_rt.objects import RemoteDir, StorageOptions, remote_manifest
from dataset_rt.roots import PathLike, is_url, resolve_root
from dataset_rt.transfers import in_parallel

__all__ = ["is_url", "pull", "push"]


def push(
    name: str,
    url: str,
    *,
    root: PathLike | None = None,
    storage_options: StorageOptions = None,
    overwrite: bool = False,
    progress: bool = True,
) -> str:
    """Uploads local cache ``name`` to ``<url>/<name>/``; returns that URL.

    Each file the manifest names is checked against its recorded size and checksum before
    it is uploaded, and the manifest goes last: a remote reader sees the previous manifest
    (or none) until every file of the new one is in place. Pushing the same build again
    uploads what changed (a new metadata version, say). Another build of ``name`` at the
    remote is replaced only with ``overwrite=True``: its manifest is deleted first, so that
    its readers, which fetch shards on demand, get
    :class:`~dataset_rt.errors.StaleCacheError` rather than the new build's shards, and the
    objects it had that the new build has not are deleted last.

    Raises
    ------
    CacheNotFoundError
        No cache ``name`` under the local root.
    CacheCorruptError
        A local file does not match the manifest; nothing of the manifest is uploaded.
    CacheIOError
        The object store failed (the message names the object, and the bucket if missing).
    ArgumentError
        Another build of ``name`` is already there and ``overwrite`` is False.
    """
    root_path = resolve_root(root)
    store = _native.Store(str(root_path))
    manifest = store.manifest(name)
    remote = RemoteDir(url, name, storage_options)
    existing = remote_manifest(remote)
    remote_id = None if existing is None else existing[1].cache_id
    if existing is not None and remote_id != manifest.cache_id:
        if not overwrite:
            raise ArgumentError(
                f"{remote.url} holds another build of {name!r} (cache_id "
                f"{remote_id}, this one {manifest.cache_id}); push under another "
                "name, or pass overwrite=True to replace it"
            )
        remote.delete(_native.MANIFEST_FILE)
    local = root_path / name

    def upload(entry: tuple[str, str | None]) -> int:
        file, checksum = entry
        _check_local(local / file, checksum)
        remote.upload(file, local / file)
        return (local / file).stat().st_size

    in_parallel(manifest.files, upload, f"push {name}", progress)
    remote.upload(_native.MANIFEST_FILE, local / _native.MANIFEST_FILE)
    if existing is not None and remote_id != manifest.cache_id:
        # What the replaced build had and this one has not (shards past its last, say).
        kept = {file for file, _ in manifest.files} | {_native.MANIFEST_FILE}
        for path in remote.paths():
            if path not in kept:
                remote.delete(path)
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
    remote = RemoteDir(url, name, storage_options)
    found = remote_manifest(remote)
    if found is None:
        raise CacheNotFoundError(
            f"no cache {name!r} under {url} ({remote.where(_native.MANIFEST_FILE)})"
        )
    raw, remote_manifest_ = found
    remote_id = remote_manifest_.cache_id
    store = _native.Store(str(root_path))
    with store.lock(name) as lock:
        if store.exists(name):
            local_id = store.manifest(name).cache_id
            if local_id == remote_id:
                return Cache(registry.open_reader(root_path, name), root_path)
            if not overwrite:
                raise ArgumentError(
                    f"{root_path / name} holds another build of {name!r} (cache_id "
                    f"{local_id}, the remote one {remote_id}); pass "
                    "overwrite=True to replace it"
                )
        copy = Path(store.begin_copy(lock))
        ok = False
        try:
            (copy / _native.MANIFEST_FILE).write_bytes(raw)  # byte for byte, as pushed
            files = [file for file, _ in remote_manifest_.files]

            def download(file: str) -> int:
                return remote.download(file, copy / file)

            in_parallel(files, download, f"pull {name}", progress)
            store.publish_copy(lock, copy)
            ok = True
        finally:
            if not ok:
                store.discard_copy(copy)
    return Cache(registry.open_reader(root_path, name), root_path)

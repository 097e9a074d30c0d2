"""Finding the cache behind a ``cache_id``, for frames that carry only ids.

A metadata frame knows each row's ``(cache_id, sample_id)`` but not where the cache lives.
Every cache opened or built in this process is opened through :func:`open_reader`, which
remembers it by id; other ids are looked up among the caches under the given root, the
roots seen so far and the default root. This table is one of the package's two pieces of
process-wide state, with :mod:`dataset_rt.fetch`'s local copies (the engine's are its shard
mappings, its SIGBUS guard and its fetchers). :func:`list_caches` lists a root's caches.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import polars as pl

from dataset_rt import _native
from dataset_rt._version_check import CACHE_ID_DTYPE
from dataset_rt.errors import CacheCorruptError, CacheNotFoundError
from dataset_rt.roots import PathLike, default_root, resolve_root, root_url

__all__ = [
    "decoder_of",
    "forget_root",
    "list_caches",
    "locate",
    "open_reader",
    "remember_decoder",
    "remember_version",
    "saved_version",
    "utc_time",
]

# Reentrant: a frame's weakref callback may run (and take it) during a collection that
# happens while this thread holds it.
_lock = threading.RLock()
_places: dict[str, tuple[Path, str]] = {}  # cache_id -> (root, name)
_roots: dict[Path, None] = {}  # roots seen, in order
# id(LazyFrame) -> (a weak reference to it, the cache, the metadata version it scans)
_versions: dict[int, tuple[weakref.ref[Any], Any, int]] = {}
# cache_id -> the decode= its last Cache in this process was opened or built with
_decoders: dict[str, Any] = {}


def open_reader(root: Path, name: str) -> _native.CacheReader:
    """Opens cache ``name`` under ``root`` and remembers where its ``cache_id`` lives.

    Raises
    ------
    CacheNotFoundError
        No cache of that name exists under the root.
    """
    reader = _native.Store(str(root)).open(name)
    with _lock:
        _places[reader.manifest.cache_id] = (root, name)
        _roots.setdefault(root)
    return reader


def _search(cache_id: str, roots: Iterable[Path]) -> tuple[Path, str] | None:
    for root in roots:
        store = _native.Store(str(root))
        for name in store.names():
            try:
                manifest = store.manifest(name)
            except (CacheCorruptError, CacheNotFoundError):
                continue
            if manifest.cache_id == cache_id:
                return root, name
    return None


def locate(cache_id: str, root: PathLike | None = None) -> tuple[_native.CacheReader, Path]:
    """A reader of the cache whose build has id ``cache_id``, and the root it lives under.

    Raises
    ------
    CacheNotFoundError
        No cache with this id exists where it was seen, nor under ``root``, the roots used
        so far in this process, or the default root. A cache rebuilt under its old name has
        a new id, so frames of the old build fail here instead of reading the wrong bytes.
    """
    with _lock:
        known = _places.get(cache_id)
        roots = list(_roots)
    candidates: list[tuple[Path, str]] = [known] if known else []
    for root_path, name in candidates:
        try:
            reader = open_reader(root_path, name)
        except CacheNotFoundError:
            continue
        if reader.manifest.cache_id == cache_id:
            return reader, root_path
    if root is not None:
        search_roots = [resolve_root(root)]
    else:  # a remote default root's caches were opened (and remembered) through their copies
        search_roots = roots if root_url(None) else [*roots, default_root()]
    found = _search(cache_id, dict.fromkeys(search_roots))
    if found is None:
        where = ", ".join(str(r) for r in dict.fromkeys(search_roots)) or "no root seen yet"
        raise CacheNotFoundError(
            f"no cache with cache_id {cache_id!r} under {where}; it was rebuilt or deleted, "
            "or lives under another root (pass root=)"
        )
    root_path, name = found
    return open_reader(root_path, name), root_path


def remember_decoder(cache_id: str, decode: Any) -> None:
    """Records the ``decode=`` a cache was opened with, for loaders over its frames.

    A frame carries only ``cache_id``: a loader built from ``cache.metadata`` reopens the
    cache by id and decodes with the decoder its ``Cache`` had (the latest one given).
    """
    with _lock:
        _decoders[cache_id] = decode


def decoder_of(cache_id: str) -> Any:
    """The ``decode=`` last given for ``cache_id`` in this process, or None."""
    with _lock:
        return _decoders.get(cache_id)


def forget_root(root: Path) -> None:
    """Stops looking for caches under ``root`` (a directory about to be deleted)."""
    with _lock:
        _roots.pop(root, None)
        for cache_id in [i for i, (r, _) in _places.items() if r == root]:
            del _places[cache_id]


def remember_version(frame: Any, cache: Any, version: int) -> None:
    """Records that the LazyFrame ``frame`` scans metadata ``version`` of ``cache`` unchanged.

    LazyFrames are immutable: every operation returns a new one, so as long as this object
    lives it means exactly that version. The entry goes with the frame.
    """
    key = id(frame)

    def forget(_: object) -> None:
        with _lock:
            _versions.pop(key, None)

    with _lock:
        _versions[key] = (weakref.ref(frame, forget), cache, version)


def saved_version(frame: Any) -> tuple[Any, int] | None:
    """The (cache, version) that ``frame`` is an unchanged scan of, if it is one."""
    with _lock:
        entry = _versions.get(id(frame))
    if entry is None or entry[0]() is not frame:
        return None
    return entry[1], entry[2]


def utc_time(stamp: str) -> datetime:
    """Parses the manifest's RFC 3339 UTC time (``...Z``; Python 3.10 reads only ``+00:00``)."""
    return datetime.fromisoformat(stamp.removesuffix("Z") + "+00:00")


def list_caches(
    root: PathLike | None = None, *, storage_options: Mapping[str, Any] | None = None
) -> pl.DataFrame:
    """The caches under a root, one row each: name, cache_id, samples, bytes, created.

    ``root`` may be an object-storage URL, read with ``storage_options`` (see :func:`open`).

    Examples
    --------
    >>> import dataset_rt as drt
    >>> drt.list_caches().columns
    ['name', 'cache_id', 'samples', 'bytes', 'shards', 'serializer', 'created']
    """
    url = root_url(root)
    if url is not None:
        remote = []
        from dataset_rt import objects

        for name in objects.list_names(url, storage_options):
            try:
                remote.append(objects.read_manifest(objects.RemoteDir(url, name, storage_options)))
            except (CacheNotFoundError, CacheCorruptError):
                continue  # removed or replaced while listing
        return manifest_rows(remote)
    store = _native.Store(str(resolve_root(root)))
    manifests = []
    for name in store.names():
        try:
            manifests.append(store.manifest(name))
        except CacheCorruptError:
            continue
    return manifest_rows(manifests)


def manifest_rows(manifests: Iterable[_native.Manifest]) -> pl.DataFrame:
    """The rows :func:`list_caches` shows for these manifests."""
    rows = [
        {
            "name": m.name,
            "cache_id": m.cache_id,
            "samples": m.num_samples,
            "bytes": m.nbytes,
            "shards": m.num_shards,
            "serializer": m.serializer,
            "created": utc_time(m.created_at),
        }
        for m in manifests
    ]
    schema: dict[str, pl.DataType] = {
        "name": pl.String(),
        "cache_id": CACHE_ID_DTYPE,
        "samples": pl.Int64(),
        "bytes": pl.Int64(),
        "shards": pl.Int64(),
        "serializer": pl.String(),
        "created": pl.Datetime("us", "UTC"),
    }
    return pl.DataFrame(rows, schema=schema, orient="row")

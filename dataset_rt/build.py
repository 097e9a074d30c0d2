"""Building caches: :func:`cache`, in one process or several (appending: `appends`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dataset_rt import _native, registry, roots
from dataset_rt.caches import Cache
from dataset_rt.caches import open as open_cache
from dataset_rt.errors import (
    ArgumentError,
    CacheCorruptError,
    CacheNotFoundError,
)
from dataset_rt.metadata import MetadataCollector
from dataset_rt.progress import BuildProgress
from dataset_rt.records import (
    BuildOptions,
    Shared,
    Source,
    check_num_proc,
    length_of,
    parallel_source,
    records_of,
    write_records,
    write_shares,
)
from dataset_rt.roots import PathLike, resolve_root, root_url
from dataset_rt.serialize import Decoder, SerializerSpec, resolve_serializer
from dataset_rt.versions import write_version

__all__ = ["DEFAULT_SHARD_SIZE", "cache", "check_name"]

DEFAULT_SHARD_SIZE = 256 << 20
DEFAULT_ALIGNMENT = 16

Compression = str | tuple[str, int] | None
"""``None``, ``"zstd"``, ``("zstd", level)`` or ``"lz4"``: how :func:`cache` compresses."""


def compression_args(compression: Compression) -> tuple[str, int | None]:
    """``compression`` as the native writer takes it: a codec name and a zstd level.

    Raises :class:`ArgumentError` for anything else, naming it; the native writer checks the
    level's range.
    """
    if compression is None:
        return "none", None
    if compression in ("zstd", "lz4"):
        return str(compression), None
    if (
        isinstance(compression, tuple)
        and len(compression) == 2
        and compression[0] == "zstd"
        and isinstance(compression[1], int)
        and not isinstance(compression[1], bool)
    ):
        return "zstd", compression[1]
    raise ArgumentError(
        f'compression must be None, "zstd", ("zstd", level) or "lz4", got {compression!r}'
    )


def check_name(name: object) -> None:
    """Refuses a cache name that is not a str or not allowed (``CacheNameError``)."""
    if not isinstance(name, str):
        raise ArgumentError(f"name must be a str, not {type(name).__name__}")
    _native.validate_name(name)


def _try_open(root: Path, name: str, decode: Decoder | None) -> Cache | None:
    try:
        reader = registry.open_reader(root, name)
    except CacheNotFoundError:
        return None
    return Cache(reader, root, decode)


def cache(
    source: Source,
    name: str,
    *,
    root: PathLike | None = None,
    metadata: Callable[[Any], Mapping[str, Any]] | None = None,
    serializer: SerializerSpec = "pickle",
    decode: Decoder | None = None,
    overwrite: bool = False,
    progress: bool = True,
    shard_size: int = DEFAULT_SHARD_SIZE,
    alignment: int | None = None,
    num_proc: int | None = None,
    compression: Compression = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Cache:
    """Caches the records of ``source`` once under ``name``, or reuses that cache.

    If a cache called ``name`` already exists under ``root``, it is returned as it is and
    ``source`` is not iterated (a callable source is not even called). Change the name when
    the preprocessing or the source changes, or pass ``overwrite=True``.

    Concurrent calls with the same name and root, from any number of processes (every rank
    of a DDP job, say), build once: one process builds, the others wait and open its cache.
    A build that fails or is killed leaves no cache behind, and an existing cache of the
    same name stays as it was.

    Parameters
    ----------
    source
        An iterable of records (a list, a generator, an iterable-style PyTorch dataset), a
        map-style dataset (``__len__`` and ``__getitem__``, such as most
        ``torch.utils.data.Dataset`` classes: records ``source[0]`` to
        ``source[len(source) - 1]``), or a zero-argument callable returning either.
    name
        The cache's name: letters, digits and ``. _ + = @ -``; it becomes a directory
        under ``root``.
    root
        The directory holding the caches, or an object-storage URL (``s3://bucket/prefix``,
        ``gs://``, ``az://``, ``file://``); default ``$DATASET_RT_HOME`` (either kind) or
        ``~/.cache/dataset_rt``. For a URL the cache is built on this machine (under the
        local directory of :func:`~dataset_rt.open`), then uploaded: payload files first,
        the manifest last, so that no reader sees it half published. Concurrent builds of
        one name take turns on one machine only: build a remote cache from one process.
    metadata
        ``metadata(record) -> dict`` of primitive attributes (int, float, bool, str, None)
        stored in the metadata table. Every record must give the same keys, each with one
        type. A ``weight`` key sets the initial sampling weight (default 1.0).
    serializer
        ``"pickle"`` (protocol 5 with large arrays stored out of band and aligned, so that
        they decode as views; the default), ``"pickle-inband"`` (plain ``pickle.dumps``),
        ``"dill"``, or a callable returning bytes.
    decode
        The decoder for a custom ``serializer``; pickle and dill caches know theirs.
    overwrite
        Rebuild even if a cache of this name exists. The old cache stays readable until
        the new one replaces it in one atomic step.
    progress
        Show a progress line (records, bytes, rate) while building.
    shard_size
        Upper bound on the size of a payload shard file, in bytes.
    alignment
        Every record starts at a multiple of this many bytes in its shard; default 16.
        Records whose arrays are stored out of band (by the default serializer) start at
        multiples of 64 whatever this says, so that their arrays are read in place.
    num_proc
        Serialize and write with this many processes (default: this one alone). The source
        must have ``__len__`` and ``__getitem__`` (a list, a NumPy array, a map-style
        dataset): each process reads its contiguous share of indices and writes it as a
        part of the cache, and ``metadata`` runs there. The source, ``metadata`` and a
        custom ``serializer`` travel to the processes with cloudpickle, so a dataset should
        pickle cheaply (file paths, not loaded data); lists and arrays send each process its
        slice only. The cache holds the same records and metadata under the same sample
        ids for any ``num_proc``.
    compression
        Compress each record: ``"zstd"`` (level 3), ``("zstd", level)`` with a level from 1
        to 22 (or negative, faster still), or ``"lz4"`` (fastest to decode). Default
        ``None``: records are stored as serialized and read in place. Records of a
        compressed cache are decompressed by the native reading threads, and their arrays
        are decoded into memory of their own rather than viewed in the mapped shard.
    storage_options
        For a URL ``root``: credentials and settings, with the keys Polars' cloud readers
        take (see :func:`~dataset_rt.open`).

    Returns
    -------
    Cache
        The new or reused cache.

    Raises
    ------
    SerializationError
        A record could not be serialized; the message names its position.
    MetadataError
        ``metadata()`` returned something that cannot be stored; the message names the
        record and the key.
    CacheNameError
        ``name`` is empty, contains a path separator, or other characters not allowed.
    CacheCorruptError
        A cache of this name exists but is damaged (pass ``overwrite=True`` to replace it).
    WorkerError
        A process of a ``num_proc`` build died; nothing was built.
    """
    procs = check_num_proc(num_proc)
    check_name(name)
    if shard_size < 1024:
        raise ArgumentError(f"shard_size must be at least 1024 bytes, got {shard_size}")
    resolve_serializer(serializer)  # an unknown one is refused before anything is written
    codec = compression_args(compression)
    if alignment is None:
        # Records with out-of-band arrays start at multiples of 64 whatever this says (the
        # writer's rule), so that the arrays are viewed in place; the others gain nothing
        # from more than 16.
        alignment = DEFAULT_ALIGNMENT
    if alignment < 1 or alignment & (alignment - 1) or alignment > 4096:
        raise ArgumentError(f"alignment must be a power of two up to 4096, got {alignment}")
    options = BuildOptions(name, metadata, serializer, progress, shard_size, alignment, codec)
    url = root_url(root)
    if url is not None:

        def build_in(staging: Path) -> None:
            _cache_at(staging, source, options, procs, decode, overwrite=False)

        return _cache_remote(url, name, storage_options, overwrite, decode, progress, build_in)
    return _cache_at(resolve_root(root), source, options, procs, decode, overwrite)


def _cache_at(
    root_path: Path,
    source: Source,
    options: BuildOptions,
    procs: int,
    decode: Decoder | None,
    overwrite: bool,
) -> Cache:
    """``cache`` under the local root ``root_path``, its arguments checked."""
    name = options.name
    store = _native.Store(str(root_path))

    if not overwrite:
        existing = _try_open_or_explain(root_path, name, decode)
        if existing is not None:
            return existing
    before = None if not store.exists(name) else published_cache_id(store, name)

    lock = store.lock(name)
    try:
        if lock.waited:
            # Another process built this name while we waited: use its cache, even with
            # overwrite=True, so that N ranks asking for a rebuild rebuild it once.
            now = _try_open_or_explain(root_path, name, decode)
            if now is not None and (not overwrite or now.cache_id != before):
                return now
        elif not overwrite:
            now = _try_open_or_explain(root_path, name, decode)
            if now is not None:
                return now
        _build(store, lock, source, options, procs)
    finally:
        lock.release()
    return Cache(registry.open_reader(root_path, name), root_path, decode)


def _cache_remote(
    url: str,
    name: str,
    storage_options: Mapping[str, Any] | None,
    overwrite: bool,
    decode: Decoder | None,
    progress: bool,
    build_in: Callable[[Path], None],
) -> Cache:
    """``cache`` for a URL root: opens the remote cache, or builds it locally and pushes it."""
    from dataset_rt import remote

    def existing() -> Cache | None:
        try:
            return open_cache(name, root=url, storage_options=storage_options, decode=decode)
        except CacheNotFoundError:
            return None

    found = None if overwrite else existing()
    if found is not None:
        return found
    local = roots.local_dir()
    local.mkdir(parents=True, exist_ok=True)
    store = _native.Store(str(local))
    # One build per machine: the others wait, then open what it pushed.
    with store.lock(f"{name}.remote") as lock:
        if lock.waited and not overwrite and (found := existing()) is not None:
            return found
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.remote-", dir=local))
        try:
            build_in(staging)
            remote.push(
                name,
                url,
                root=staging,
                storage_options=storage_options,
                overwrite=overwrite,
                progress=progress,
            )
            # The build becomes the local copy, shards and all: nothing is downloaded again.
            cache_id = _native.Store(str(staging)).manifest(name).cache_id
            copy = local / cache_id / name
            if not copy.exists():
                copy.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / name, copy)
        finally:
            registry.forget_root(staging)
            shutil.rmtree(staging, ignore_errors=True)
    return open_cache(name, root=url, storage_options=storage_options, decode=decode)


def published_cache_id(store: _native.Store, name: str) -> str | None:
    """The cache_id currently published under ``name``, or None if it is unreadable."""
    try:
        return store.manifest(name).cache_id
    except (CacheNotFoundError, CacheCorruptError):
        return None


def _try_open_or_explain(root: Path, name: str, decode: Decoder | None) -> Cache | None:
    try:
        return _try_open(root, name, decode)
    except CacheCorruptError as exc:
        raise type(exc)(f"{exc}; pass overwrite=True to rebuild cache {name!r}") from exc


def _build(
    store: _native.Store, lock: _native.BuildLock, source: Source, options: BuildOptions, procs: int
) -> None:
    records = records_of(source)
    indexed = parallel_source(records, procs)
    if indexed is not None:
        _build_parallel(store, lock, indexed, options, min(procs, len(indexed)))
        return
    ser_name, dumps = resolve_serializer(options.serializer)
    builder = store.begin_build(lock, *options.layout)
    collector = MetadataCollector()
    bar = BuildProgress(
        options.name,
        nbytes=lambda: builder.nbytes,
        enabled=options.progress,
        total=length_of(records),
    )
    ok = False
    try:
        count = write_records(
            records, builder.append, dumps, ser_name, options.metadata, collector, bar
        )
        bar.settle(count)
        frame = collector.frame(builder.cache_id, builder.num_samples)
        write_version(builder, frame, ser_name)
        builder.finish(ser_name)
        ok = True
    finally:
        if not ok:
            builder.abort()
        bar.close(ok=ok)


def _build_parallel(
    store: _native.Store,
    lock: _native.BuildLock,
    source: Any,
    options: BuildOptions,
    procs: int,
) -> None:
    n = len(source)
    ser_name = resolve_serializer(options.serializer)[0]
    builder = store.begin_build(lock, *options.layout)
    shared = Shared(options, n, own_nbytes=lambda: builder.nbytes)
    ok = False
    try:
        parts, collector = write_shares(
            source,
            procs,
            options,
            builder.append,
            str(builder.path),
            shared,
            _native.part_dir,
        )
        frame = collector.frame(builder.cache_id, n)
        write_version(builder, frame, ser_name)
        builder.finish(ser_name, parts)
        ok = True
    finally:
        shared.stop()
        if not ok:
            builder.abort()
        shared.bar.close(ok=ok)

"""Building caches: :func:`cache`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import polars as pl

from dataset_rt import _native, registry
from dataset_rt.caches import Cache, write_version_plan
from dataset_rt.errors import (
    ArgumentError,
    CacheCorruptError,
    CacheNotFoundError,
    MetadataError,
    SerializationError,
)
from dataset_rt.metadata import MetadataCollector
from dataset_rt.progress import BuildProgress
from dataset_rt.roots import PathLike, resolve_root
from dataset_rt.serialize import Decoder, SerializerSpec, as_bytes, resolve_serializer

__all__ = ["append", "cache"]

DEFAULT_SHARD_SIZE = 256 << 20
DEFAULT_ALIGNMENT = 16


class MapStyle(Protocol):
    """A map-style dataset: a length and records by index (a PyTorch ``Dataset``, say)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> Any: ...


Source = Iterable[Any] | MapStyle | Callable[[], Iterable[Any] | MapStyle]
"""An iterable of records, a map-style dataset (``__len__`` and ``__getitem__``, read at
indices ``0`` to ``len - 1``), or a zero-argument callable returning either."""


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
        The directory holding the caches; default ``$DATASET_RT_HOME`` or
        ``~/.cache/dataset_rt``.
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
    """
    if not isinstance(name, str):
        raise ArgumentError(f"name must be a str, not {type(name).__name__}")
    _native.validate_name(name)
    if shard_size < 1024:
        raise ArgumentError(f"shard_size must be at least 1024 bytes, got {shard_size}")
    ser_name, dumps = resolve_serializer(serializer)
    if alignment is None:
        # Records with out-of-band arrays start at multiples of 64 whatever this says (the
        # writer's rule), so that the arrays are viewed in place; the others gain nothing
        # from more than 16.
        alignment = DEFAULT_ALIGNMENT
    if alignment < 1 or alignment & (alignment - 1) or alignment > 4096:
        raise ArgumentError(f"alignment must be a power of two up to 4096, got {alignment}")
    root_path = resolve_root(root)
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
        _build(
            store, lock, name, source, metadata, ser_name, dumps, progress, shard_size, alignment
        )
    finally:
        lock.release()
    return Cache(registry.open_reader(root_path, name), root_path, decode)


def append(
    name: str,
    source: Source,
    *,
    root: PathLike | None = None,
    metadata: Callable[[Any], Mapping[str, Any]] | None = None,
    progress: bool = True,
) -> Cache:
    """Adds the records of ``source`` to cache ``name``; returns the grown cache.

    The new records get the next sample ids (``len(cache)`` onwards) and are written as a
    new *part* of the cache, with the cache's serializer; no existing byte is rewritten.
    Their rows join the live metadata table in a new metadata version: existing rows keep
    their values and weights, new rows get ``metadata(record)`` (columns one side lacks are
    null on the other) and weight 1 unless ``metadata`` returns a ``weight``. Everything
    appears in one atomic step: frames, scans and loaders made before it keep reading what
    they were made from, and an append that fails or is killed leaves the cache as it was.
    Appends and metadata saves of one cache, from any process, take turns.

    Parameters
    ----------
    name
        The cache to grow; it must exist under ``root``.
    source
        The records, as :func:`cache` takes them: an iterable, a map-style dataset, or a
        zero-argument callable returning either.
    root
        The directory holding the cache; default ``$DATASET_RT_HOME`` or
        ``~/.cache/dataset_rt``.
    metadata
        ``metadata(record) -> dict`` of primitive attributes for the new rows, as for
        :func:`cache`.
    progress
        Show a progress line while writing.

    Returns
    -------
    Cache
        The cache, opened anew: its length counts the new records.

    Raises
    ------
    CacheNotFoundError
        No cache of that name exists under the root.
    ArgumentError
        The cache was written with a custom serializer function, which its manifest names
        but cannot hand back.
    SerializationError, MetadataError
        A record could not be serialized, or its metadata stored; the message names its
        position in ``source``. Nothing is appended.
    """
    if not isinstance(name, str):
        raise ArgumentError(f"name must be a str, not {type(name).__name__}")
    _native.validate_name(name)
    root_path = resolve_root(root)
    store = _native.Store(str(root_path))
    with store.lock(name) as lock:
        cache = Cache(registry.open_reader(root_path, name), root_path)
        if cache.serializer.startswith("custom:"):
            raise ArgumentError(
                f"cache {name!r} was written with a custom serializer "
                f"({cache.serializer.removeprefix('custom:')}); append supports the named "
                "serializers (pickle, pickle-inband, dill) only: rebuild it with drt.cache"
            )
        ser_name, dumps = resolve_serializer(cache.serializer)  # type: ignore[arg-type]
        live = cache.metadata
        records = _records(source)
        session = store.begin_append(lock, cache.cache_id, DEFAULT_SHARD_SIZE)
        collector = MetadataCollector()
        bar = BuildProgress(
            name, nbytes=lambda: session.nbytes, enabled=progress, total=_length(records)
        )
        ok = False
        try:
            count = _write_records(
                records, session.append, dumps, ser_name, metadata, collector, bar
            )
            bar.settle(count)
            if count:
                added = collector.frame(cache.cache_id, count).with_columns(
                    pl.col("sample_id") + session.first
                )
                table = _appended_table(live, added, name)
                table.write_parquet(session.metadata_path)
                write_version_plan(session.plan_path, table)
                session.commit()
            ok = True
        finally:
            if not ok or not count:  # nothing to commit: the empty part goes
                session.abort()
            bar.close(ok=ok)
    return Cache(registry.open_reader(root_path, name), root_path)


def _appended_table(live: pl.DataFrame, added: pl.DataFrame, name: str) -> pl.DataFrame:
    """The live table with the appended rows below it; ``weight`` stays the last column.

    A column both sides have keeps its type, or widens to hold both where both are numeric.
    """
    clash = [
        f"{c!r} ({live.schema[c]} in the cache, {added.schema[c]} appended)"
        for c in added.columns
        if c in live.schema
        and live.schema[c] != added.schema[c]
        and pl.Null not in (live.schema[c], added.schema[c])
        and not (live.schema[c].is_numeric() and added.schema[c].is_numeric())
    ]
    if clash:
        raise MetadataError(
            f"the appended records' metadata does not fit cache {name!r}'s table: column "
            f"{', '.join(clash)}; a column keeps one type"
        )
    table = pl.concat([live, added], how="diagonal_relaxed")
    return table.select(pl.exclude("weight"), "weight")


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


class _ByIndex:
    """The records of a map-style dataset, ``source[0]`` to ``source[len - 1]`` in order.

    Most PyTorch ``Dataset`` classes are such: ``__len__`` and ``__getitem__``, no
    ``__iter__``. Python's fallback iteration would call ``__getitem__`` until an
    IndexError, which many datasets never raise (they wrap around, or fail otherwise).
    """

    def __init__(self, source: Any) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[Any]:
        source = self.source
        for index in range(len(source)):
            try:
                record = source[index]
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"while reading record {index} of the source ({source!r:.80})")
                raise
            yield record


def _indexable(source: object) -> bool:
    kind = type(source)
    return hasattr(kind, "__len__") and hasattr(kind, "__getitem__")


def _records(source: Source) -> Iterable[Any]:
    if isinstance(source, Iterable):
        return source
    if _indexable(source):
        return _ByIndex(source)
    if callable(source):
        produced = source()
        if _indexable(produced) and not isinstance(produced, Iterable):
            return _ByIndex(produced)
        if not isinstance(produced, Iterable):
            raise ArgumentError(
                f"source() returned {type(produced).__name__}, which is not iterable"
            )
        return produced
    raise ArgumentError(
        f"source must be an iterable of records, a map-style dataset (__len__ and "
        f"__getitem__) or a callable returning one, not {type(source).__name__}"
    )


def _length(records: Iterable[Any]) -> int | None:
    return len(records) if hasattr(records, "__len__") else None  # type: ignore[arg-type]


def _write_records(
    records: Iterable[Any],
    append: Callable[[bytes], int],
    dumps: Callable[[Any], Any],
    ser_name: str,
    metadata: Callable[[Any], Mapping[str, Any]] | None,
    collector: MetadataCollector,
    bar: BuildProgress,
) -> int:
    """Serializes each record and hands its bytes to ``append``; returns the count.

    Metadata goes to ``collector``; errors name the record by its position in ``records``.
    """
    add_metadata = collector.add
    index = -1
    for index, record in enumerate(records):
        try:
            data = dumps(record)
        except Exception as exc:
            raise SerializationError(
                f"record {index} could not be serialized with {ser_name}: {exc}"
            ) from exc
        if type(data) is not bytes:
            data = as_bytes(data, index, ser_name)
        append(data)
        if metadata is not None:
            try:
                values = metadata(record)
            except Exception as exc:
                raise MetadataError(f"metadata() raised on record {index}: {exc!r}") from exc
            add_metadata(index, values)
        bar.update(index + 1)
    return index + 1


def _build(
    store: _native.Store,
    lock: _native.BuildLock,
    name: str,
    source: Source,
    metadata: Callable[[Any], Mapping[str, Any]] | None,
    ser_name: str,
    dumps: Callable[[Any], Any],
    progress: bool,
    shard_size: int,
    alignment: int,
) -> None:
    records = _records(source)
    builder = store.begin_build(lock, shard_size, alignment)
    collector = MetadataCollector()
    bar = BuildProgress(
        name, nbytes=lambda: builder.nbytes, enabled=progress, total=_length(records)
    )
    ok = False
    try:
        count = _write_records(records, builder.append, dumps, ser_name, metadata, collector, bar)
        bar.settle(count)
        frame = collector.frame(builder.cache_id, builder.num_samples)
        frame.write_parquet(builder.metadata_path)
        write_version_plan(builder.plan_path, frame)
        builder.finish(ser_name)
        ok = True
    finally:
        if not ok:
            builder.abort()
        bar.close(ok=ok)

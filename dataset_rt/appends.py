"""Growing a cache: :func:`append` writes new records as a part and a new metadata version."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import polars as pl

from dataset_rt import _native, registry
from dataset_rt.build import DEFAULT_SHARD_SIZE, check_name
from dataset_rt.caches import Cache
from dataset_rt.errors import ArgumentError, MetadataError
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
from dataset_rt.roots import PathLike, resolve_root
from dataset_rt.serialize import resolve_serializer
from dataset_rt.versions import write_version

__all__ = ["append"]


def append(
    name: str,
    source: Source,
    *,
    root: PathLike | None = None,
    metadata: Callable[[Any], Mapping[str, Any]] | None = None,
    num_proc: int | None = None,
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
    num_proc
        Serialize and write with this many processes, as :func:`cache` does: the source must
        have ``__len__`` and ``__getitem__``, and each process's share becomes a part of its
        own. The records get the same sample ids for any ``num_proc``.
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
    procs = check_num_proc(num_proc)
    check_name(name)
    root_path = resolve_root(root)
    store = _native.Store(str(root_path))
    with store.lock(name) as lock:
        cache = Cache(registry.open_reader(root_path, name), root_path)
        if cache.serializer.startswith("custom:"):
            raise ArgumentError(
                f"cache {name!r} was written with a custom serializer "
                f"({cache.serializer.removeprefix('custom:')}); append supports the named "
                "serializers (pickle, pickle-inband, dill, tokens) only: rebuild it with drt.cache"
            )
        manifest = store.manifest(name)
        options = BuildOptions(
            name,
            metadata,
            cache.serializer,
            progress,
            DEFAULT_SHARD_SIZE,
            manifest.alignment,
            (manifest.compression, manifest.compression_level),
        )
        ser_name, dumps = resolve_serializer(options.serializer)
        live = cache.metadata
        records = records_of(source)
        indexed = parallel_source(records, procs)
        session = store.begin_append(lock, cache.cache_id, DEFAULT_SHARD_SIZE)
        shared = None
        if indexed is not None:
            shared = Shared(options, len(indexed), own_nbytes=lambda: session.nbytes)
            bar = shared.bar
        else:
            bar = BuildProgress(
                name, nbytes=lambda: session.nbytes, enabled=progress, total=length_of(records)
            )
        ok = False
        count = 0
        try:
            parts: list[str] = []
            if shared is not None and indexed is not None:
                parts, collector = write_shares(
                    indexed,
                    min(procs, len(indexed)),
                    options,
                    session.append,
                    str(session.staging_dir),
                    shared,
                    _native.AppendSession.staged_part,
                )
                count = len(indexed)
            else:
                collector = MetadataCollector()
                count = write_records(
                    records, session.append, dumps, ser_name, metadata, collector, bar
                )
                bar.settle(count)
            if count:
                added = collector.frame(cache.cache_id, count).with_columns(
                    pl.col("sample_id") + session.first
                )
                table = _appended_table(live, added, name)
                write_version(session, table, cache.serializer)
                session.commit(parts)
            ok = True
        finally:
            if shared is not None:
                shared.stop()
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

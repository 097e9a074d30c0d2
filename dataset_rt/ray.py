"""Caches written from a Ray Data ``Dataset`` by Ray's own write tasks.

``dataset_rt.ray.cache(ds, name)`` runs one write job through Ray's ``Datasink`` API: each
write task serializes its rows and writes them as a *part* of the cache (shards and an index
of its own), and the job's completion lists every part in the manifest that publishes the
cache. Nothing is visible under the name until then; a failed job leaves nothing, and a
task that Ray retries writes its part afresh (what a failed attempt wrote is removed).

Needs the ``ray`` extra: ``pip install "dataset-rt[ray]"``. Every Ray node must see the
cache root at the same path (a local root for a single-machine cluster, a shared
filesystem for several machines).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dataset_rt import _native, registry
from dataset_rt.build import (
    DEFAULT_ALIGNMENT,
    DEFAULT_SHARD_SIZE,
    Compression,
    _try_open,
    check_name,
    compression_args,
)
from dataset_rt.caches import Cache
from dataset_rt.errors import ArgumentError
from dataset_rt.metadata import MetadataCollector
from dataset_rt.records import BuildOptions, write_records
from dataset_rt.roots import PathLike, resolve_root
from dataset_rt.serialize import resolve_serializer
from dataset_rt.versions import write_version

try:
    import ray
    import ray.data
    from ray.data.block import BlockAccessor
    from ray.data.datasource.datasink import Datasink, WriteResult
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'dataset_rt.ray needs Ray Data: pip install "dataset-rt[ray]" (or "ray[data]")'
    ) from exc

if TYPE_CHECKING:
    from ray.data._internal.execution.interfaces import TaskContext

__all__ = ["cache"]

MetadataSpec = Sequence[str] | Callable[[dict[str, Any]], Mapping[str, Any]] | None
"""Column names copied into the metadata table, or ``metadata(row) -> dict``, or None."""

# What a write task hands back: its index, its part's directory, description and number of
# records, and the records' metadata.
_TaskResult = tuple[int, str, str, int, MetadataCollector]


def cache(
    ds: ray.data.Dataset,
    name: str,
    *,
    root: PathLike | None = None,
    metadata: MetadataSpec = None,
    compression: Compression = None,
    progress: bool = True,
) -> Cache:
    """Writes the rows of ``ds`` into a new cache ``name``, or reuses that cache.

    Each row becomes one record: a dict of its columns (NumPy arrays for tensor columns),
    serialized with the default ``pickle`` serializer, so ``cache.get(i)`` returns that
    dict. Rows keep the order of the dataset's blocks: sample ids follow the write tasks'
    order, and each task's rows in its order.

    As with :func:`dataset_rt.cache`, a cache of that name under ``root`` is returned as it
    is, without running ``ds``; concurrent callers build once.

    Parameters
    ----------
    ds
        The Ray dataset. Its write job runs on the cluster ``ray.init`` connected to.
    name
        The cache's name.
    root
        The directory holding the caches; every Ray node must see it at this path.
        Default ``$DATASET_RT_HOME`` or ``~/.cache/dataset_rt``.
    metadata
        Column names whose values go into the metadata table (primitive values only), or a
        function of the row returning a dict of primitive values, as :func:`dataset_rt.cache`
        takes. A ``weight`` entry sets the initial sampling weight.
    compression
        ``None``, ``"zstd"``, ``("zstd", level)`` or ``"lz4"``, as :func:`dataset_rt.cache`.
    progress
        Show Ray Data's progress bars while writing.

    Returns
    -------
    Cache
        The cache the dataset's rows were written to, or the one already under ``name``.

    Raises
    ------
    ArgumentError
        ``ds`` is not a Ray dataset, or ``metadata`` is neither column names nor a function.
    MetadataError, SerializationError
        A row could not be stored; the job fails and nothing is built.
    """
    if not isinstance(ds, ray.data.Dataset):
        raise ArgumentError(f"ds must be a ray.data.Dataset, not {type(ds).__name__}")
    check_name(name)
    options = BuildOptions(
        name,
        _metadata_function(metadata),
        "pickle",
        progress,
        DEFAULT_SHARD_SIZE,
        DEFAULT_ALIGNMENT,
        compression_args(compression),
    )
    root_path = resolve_root(root)
    existing = _try_open(root_path, name, None)
    if existing is not None:
        return existing
    store = _native.Store(str(root_path))
    with store.lock(name) as lock:
        existing = _try_open(root_path, name, None)
        if existing is not None:
            return existing
        builder = store.begin_build(lock, *options.layout)
        sink = _CacheDatasink(builder, options)
        context = ray.data.DataContext.get_current()
        saved = context.enable_progress_bars, context.execution_options.preserve_order
        # Blocks reach the write tasks in the dataset's order, so that the tasks' order is
        # the rows' order and a rebuild gives every row the same sample id.
        context.enable_progress_bars = progress
        context.execution_options.preserve_order = True
        try:
            ds.write_datasink(sink)
        finally:
            context.enable_progress_bars, context.execution_options.preserve_order = saved
            if not sink.committed:
                builder.abort()
    return Cache(registry.open_reader(root_path, name), root_path)


def _metadata_function(
    metadata: MetadataSpec,
) -> Callable[[dict[str, Any]], Mapping[str, Any]] | None:
    if metadata is None or callable(metadata):
        return metadata
    if isinstance(metadata, str):
        metadata = [metadata]
    if isinstance(metadata, Sequence) and all(isinstance(c, str) for c in metadata):
        return _Columns(tuple(metadata))
    raise ArgumentError(
        "metadata must be a list of column names or a function of the row, "
        f"not {type(metadata).__name__}"
    )


class _Columns:
    """``metadata`` given as column names: those columns of each row."""

    def __init__(self, columns: tuple[str, ...]) -> None:
        self.columns = columns

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            return {column: row[column] for column in self.columns}
        except KeyError as exc:
            raise KeyError(
                f"metadata column {exc.args[0]!r} is not a column of the dataset "
                f"(it has {sorted(row)})"
            ) from None


class _NoProgress:
    @staticmethod
    def update(records: int) -> None:
        pass


def _rows(blocks: Iterable[Any]) -> Iterator[dict[str, Any]]:
    for block in blocks:
        rows: Iterable[Mapping[str, Any]] = BlockAccessor.for_block(block).iter_rows(
            public_row_format=True
        )
        for row in rows:
            yield dict(row)


class _CacheDatasink(Datasink[_TaskResult]):
    """Write tasks write parts into the build directory; completion publishes the cache.

    The driver keeps the build (``builder``); the tasks receive a copy without it.
    """

    def __init__(self, builder: _native.CacheBuilder, options: BuildOptions) -> None:
        self.builder: _native.CacheBuilder | None = builder
        self.build_dir = str(builder.path)
        self.metadata = options.metadata
        self.layout = options.layout
        self.committed = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["builder"] = None  # native and the driver's own: never sent to a task
        return state

    def get_name(self) -> str:
        return "dataset_rt"

    def write(self, blocks: Iterable[Any], ctx: TaskContext) -> _TaskResult:
        # A directory of this attempt's own: a retried task never writes into what a failed
        # attempt left, which completion removes.
        relative = f"{_native.PARTS_DIR}/.ray-{ctx.task_idx:05d}-{secrets.token_hex(4)}"
        ser_name, dumps = resolve_serializer("pickle")
        writer = _native.PartWriter(self.build_dir, relative, *self.layout)
        collector = MetadataCollector()
        write_records(
            _rows(blocks), writer.append, dumps, ser_name, self.metadata, collector, _NoProgress()
        )
        count = writer.num_samples
        return ctx.task_idx, relative, writer.finish(), count, collector

    def on_write_complete(self, write_result: WriteResult[_TaskResult]) -> None:
        builder = self.builder
        if builder is None:
            raise RuntimeError("on_write_complete ran outside the driver")
        build_dir = Path(self.build_dir)
        results = sorted(write_result.write_returns, key=lambda r: r[0])
        collector = MetadataCollector()
        parts: list[str] = []
        kept: set[str] = set()
        first = 0
        for _, staged, part, count, part_metadata in results:
            if count == 0:
                continue
            final = _native.part_dir(len(parts) + 1)
            (build_dir / staged).rename(build_dir / final)
            parts.append(_native.relocate_part(part, staged, final))
            kept.add(final)
            collector.merge(part_metadata, first)
            first += count
        # What failed attempts and empty tasks wrote goes before the cache is published.
        for leftover in (build_dir / _native.PARTS_DIR).glob("*"):
            if f"{_native.PARTS_DIR}/{leftover.name}" not in kept:
                shutil.rmtree(leftover)
        frame = collector.frame(builder.cache_id, first)
        write_version(builder, frame, "pickle")
        builder.finish("pickle", parts)
        self.committed = True

    def on_write_failed(self, error: Exception) -> None:
        # Removes the build directory with every part written so far (the driver's
        # ``cache`` does the same after any failure; removing twice is harmless).
        if self.builder is not None and not self.committed:
            self.builder.abort()

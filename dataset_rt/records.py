"""A build's records on their way to a cache: read, serialized, their metadata collected.

:func:`write_records` is the loop every build runs (``drt.cache``, ``drt.append``, Ray Data's
write tasks); :func:`write_shares` runs it in spawned processes, each writing its
contiguous share of the source as a part of the build.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dataset_rt import _native
from dataset_rt.errors import ArgumentError, MetadataError, SerializationError, WorkerError
from dataset_rt.metadata import MetadataCollector
from dataset_rt.progress import BuildProgress
from dataset_rt.serialize import SerializerSpec, as_bytes, resolve_serializer, token_count

if TYPE_CHECKING:  # parallel builds only: imported when one starts, not with the package
    import multiprocessing.process
    from multiprocessing.connection import Connection

__all__ = [
    "BuildOptions",
    "ByIndex",
    "MapStyle",
    "Progress",
    "Shared",
    "Source",
    "check_num_proc",
    "length_of",
    "parallel_source",
    "records_of",
    "write_records",
    "write_shares",
]


class Progress(Protocol):
    """What counts a build's records as they are written (a progress bar, say)."""

    def update(self, records: int) -> None:
        """``records`` records are written so far."""


class MapStyle(Protocol):
    """A map-style dataset: a length and records by index (a PyTorch ``Dataset``, say)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> Any: ...


Source = Iterable[Any] | MapStyle | Callable[[], Iterable[Any] | MapStyle]
"""An iterable of records, a map-style dataset (``__len__`` and ``__getitem__``, read at
indices ``0`` to ``len - 1``), or a zero-argument callable returning either."""


class ByIndex:
    """The records of a map-style dataset, ``source[0]`` to ``source[len - 1]`` in order.

    Most PyTorch ``Dataset`` classes are such: ``__len__`` and ``__getitem__``, no
    ``__iter__``. Python's fallback iteration would call ``__getitem__`` until an
    IndexError, which many datasets never raise (they wrap around, or fail otherwise).
    """

    def __init__(self, source: Any, start: int = 0, stop: int | None = None, base: int = 0) -> None:
        # Records ``source[start:stop]``; ``base + i`` is record i's index in the whole
        # source (``source`` may be a slice of it, sent to another process).
        self.source, self.start, self.base = source, start, base
        self.stop = len(source) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[Any]:
        source = self.source
        for index in range(self.start, self.stop):
            try:
                record = source[index]
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(
                        f"while reading record {self.base + index} of the source ({source!r:.80})"
                    )
                raise
            yield record


def parallel_source(records: Iterable[Any], procs: int) -> Any | None:
    """The sized, indexable source that ``procs`` processes share out, if they do.

    None when one process writes ``records``: one process asked for, or one record or none.
    """
    if procs < 2:
        return None
    indexed: Any = records.source if isinstance(records, ByIndex) else records
    if not indexable(indexed):
        raise ArgumentError(
            f"num_proc={procs} needs a source with __len__ and __getitem__ (a list, an "
            f"array, a map-style dataset), not {type(indexed).__name__}: each process "
            "reads its share by index. Pass num_proc=None to read it in order here"
        )
    return indexed if len(indexed) > 1 else None


def check_num_proc(num_proc: object) -> int:
    """``num_proc`` as a count of processes (None: 1); refuses anything else."""
    if num_proc is None:
        return 1
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ArgumentError(f"num_proc must be a positive int or None, got {num_proc!r}")
    return num_proc


def indexable(source: object) -> bool:
    kind = type(source)
    return hasattr(kind, "__len__") and hasattr(kind, "__getitem__")


def records_of(source: Source) -> Iterable[Any]:
    """The records of ``source`` (see :data:`Source`) as an iterable, in order."""
    if isinstance(source, Iterable):
        return source
    if indexable(source):
        return ByIndex(source)
    if callable(source):
        produced = source()
        if indexable(produced) and not isinstance(produced, Iterable):
            return ByIndex(produced)
        if not isinstance(produced, Iterable):
            raise ArgumentError(
                f"source() returned {type(produced).__name__}, which is not iterable"
            )
        return produced
    raise ArgumentError(
        f"source must be an iterable of records, a map-style dataset (__len__ and "
        f"__getitem__) or a callable returning one, not {type(source).__name__}"
    )


def length_of(records: Iterable[Any]) -> int | None:
    """How many records there are, if ``records`` says."""
    return len(records) if hasattr(records, "__len__") else None  # type: ignore[arg-type]


def write_records(
    records: Iterable[Any],
    append: Callable[[bytes], int],
    dumps: Callable[[Any], Any],
    ser_name: str,
    metadata: Callable[[Any], Mapping[str, Any]] | None,
    collector: MetadataCollector,
    bar: Progress,
    first: int = 0,
) -> int:
    """Serializes each record and hands its bytes to ``append``; returns the count.

    Metadata goes to ``collector``; errors name the record by its position in the whole
    source, ``records`` being its part from index ``first`` on.
    """
    add_metadata = collector.add
    tokens = ser_name == "tokens" or ser_name.startswith("tokens:")
    count = 0
    for count, record in enumerate(records, 1):
        index = first + count - 1
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
            if tokens:
                values = _with_length(values, token_count(data), index)
            add_metadata(index, values)
        elif tokens:
            add_metadata(index, {"length": token_count(data)})
        bar.update(count)
    return count


def _with_length(values: Any, length: int, index: int) -> Any:
    """A token document's metadata: the user's, and its ``length`` in tokens."""
    if not isinstance(values, Mapping):
        return values  # the collector says what is wrong with it
    if values.get("length", length) != length:
        raise MetadataError(
            f"metadata() returned length {values['length']!r} for record {index}, which holds "
            f"{length} tokens: a token cache fills in each document's length itself"
        )
    return {**values, "length": length}


@dataclass(frozen=True)
class BuildOptions:
    """How a build writes its records (the arguments of :func:`cache` that say so)."""

    name: str
    metadata: Callable[[Any], Mapping[str, Any]] | None
    serializer: SerializerSpec
    progress: bool
    shard_size: int
    alignment: int
    compression: tuple[str, int | None] = ("none", None)

    @property
    def layout(self) -> tuple[int, int, str, int | None]:
        """How the native writers lay records out: shard size, alignment, compression."""
        return (self.shard_size, self.alignment, *self.compression)


# -- parallel builds ------------------------------------------------------------------------
@dataclass
class _Worker:
    """A process writing records ``lo`` to ``hi - 1`` as part ``relative`` of the build."""

    process: multiprocessing.process.BaseProcess
    results: Connection
    counts: Any  # a shared array: records and bytes written so far
    lo: int
    hi: int

    def failure(self) -> BaseException | None:
        """Why the process ended without a part, if it did (it is not waited for)."""
        code = self.process.exitcode
        if code is None or code == 0:
            return None
        import signal

        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        return WorkerError(
            f"the process writing records {self.lo} to {self.hi - 1} died ({how}); "
            "nothing was built"
        )


class Shared:
    """The progress of a build in several processes: this one's records plus the workers'."""

    def __init__(self, options: BuildOptions, total: int, own_nbytes: Callable[[], int]) -> None:
        self.workers: list[_Worker] = []
        self.own = 0
        self.bar = BuildProgress(
            options.name,
            nbytes=lambda: own_nbytes() + sum(w.counts[1] for w in self.workers),
            enabled=options.progress,
            total=total,
        )

    def update(self, records: int) -> None:
        """Counts ``records`` written here; checks that no worker died meanwhile."""
        self.own = records
        if records % 1024 == 0:
            for worker in self.workers:
                failure = worker.failure()
                if failure is not None:
                    raise failure
            self.refresh()

    def refresh(self) -> None:
        """Shows the records written by every process."""
        self.bar.update(self.own + sum(w.counts[0] for w in self.workers))

    def stop(self) -> None:
        """Kills the workers still running (after a failure) and waits for every one."""
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join()
            worker.results.close()


def _share(source: Any, lo: int, hi: int) -> tuple[Any, int, int, int]:
    """What a worker needs to read records ``lo`` to ``hi - 1``: (object, start, stop, base).

    Lists, tuples and arrays are sliced, so that each process is sent its records only;
    other sources (datasets that load records from files) are sent whole.
    """
    if isinstance(source, list | tuple) or type(source).__module__ == "numpy":
        return source[lo:hi], 0, hi - lo, lo
    return source, lo, hi, 0


def write_shares(
    source: Any,
    procs: int,
    options: BuildOptions,
    append: Callable[[bytes], int],
    target: str,
    shared: Shared,
    relative: Callable[[int], str],
) -> tuple[list[str], MetadataCollector]:
    """Writes ``source`` in ``procs`` contiguous shares; returns the parts and the metadata.

    The first share goes through ``append`` here, each other one is written by a spawned
    process as part ``relative(j)`` of directory ``target``. The parts' descriptions come
    in order, and the metadata covers every record. The caller stops the processes
    (``shared.stop()``) however this ends.
    """
    n = len(source)
    bounds = [n * j // procs for j in range(procs + 1)]
    import cloudpickle

    from dataset_rt.processes import SpawnContext

    ser_name, dumps = resolve_serializer(options.serializer)
    context = SpawnContext()
    for j in range(1, procs):
        lo, hi = bounds[j], bounds[j + 1]
        payload = cloudpickle.dumps((_share(source, lo, hi), options.serializer, options.metadata))
        receive, send = context.Pipe(duplex=False)
        counts = context.Array("q", 2, lock=False)
        process = context.Process(
            target=_write_part,
            args=(payload, target, relative(j), options.layout, counts, send),
            name=f"dataset_rt build {options.name} part {j}",
            daemon=True,
        )
        process.start()
        send.close()
        shared.workers.append(_Worker(process, receive, counts, lo, hi))
    collector = MetadataCollector()
    own = ByIndex(source, 0, bounds[1])
    write_records(own, append, dumps, ser_name, options.metadata, collector, shared)
    parts = []
    for worker in shared.workers:
        part, part_metadata = _result_of(worker, shared)
        parts.append(part)
        collector.merge(part_metadata, worker.lo)
    shared.bar.settle(n)
    return parts, collector


def _result_of(worker: _Worker, shared: Shared) -> tuple[str, MetadataCollector]:
    """The part a worker wrote and its metadata, once it is done; raises what it raised."""
    while not worker.results.poll(0.2):
        shared.refresh()
        failure = worker.failure()
        if failure is not None:
            raise failure
    try:
        outcome = worker.results.recv()
    except EOFError:  # it died between its last write and its answer
        worker.process.join()
        raise worker.failure() or WorkerError(
            f"the process writing records {worker.lo} to {worker.hi - 1} ended without "
            "its part; nothing was built"
        ) from None
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1], outcome[2]


def _write_part(
    payload: bytes,
    build_dir: str,
    relative: str,
    layout: tuple[int, int, str, int | None],
    counts: Any,
    results: Connection,
) -> None:
    """A parallel build's worker: writes its share of the records as one part."""
    import cloudpickle

    try:
        (source, start, stop, base), serializer, metadata = cloudpickle.loads(payload)
        ser_name, dumps = resolve_serializer(serializer)
        writer = _native.PartWriter(build_dir, relative, *layout)
        first = base + start

        class Counter:
            @staticmethod
            def update(records: int) -> None:
                counts[0] = records
                if records % 256 == 0:
                    counts[1] = writer.nbytes

        collector = MetadataCollector()
        write_records(
            ByIndex(source, start, stop, base),
            writer.append,
            dumps,
            ser_name,
            metadata,
            collector,
            Counter(),
            first=first,
        )
        results.send(("ok", writer.finish(), collector))
    except BaseException as exc:
        try:
            results.send(("error", exc))
        except Exception:  # an exception that does not pickle
            results.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
    finally:
        results.close()

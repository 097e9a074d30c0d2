"""One batch's way from the native reader to the training loop: decode, transform, collate.

The same code runs in the loader's own process and in its worker processes; a
:class:`LoaderSpec` carries what it needs across.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dataset_rt import _native
from dataset_rt.errors import CacheCorruptError, SerializationError, TransformError
from dataset_rt.serialize import Decoder

if TYPE_CHECKING:
    from dataset_rt.transfers import ShardPrefetch

__all__ = ["Collate", "LoaderSpec", "LoaderStats", "Transform", "assemble", "decode_batch"]

Collate = Callable[[list[Any]], Any]
Transform = Callable[[Any], Any]


@dataclass(frozen=True)
class LoaderSpec:
    """Everything a process needs to read a loader's batches; small and picklable."""

    plan: str
    cache_dirs: tuple[str, ...]
    cache_ids: tuple[str, ...]
    cache_names: tuple[str, ...]
    decoders: tuple[Decoder, ...]
    transform: Transform | None
    collate: Collate
    seed: int
    depth: int
    verify: bool
    views: bool = False
    """Every cache uses its default pickle decoder (``decoders`` are :func:`loads`): batches
    decode in one native loop, arrays as views of the mapped shard (large records) or of the
    batch buffer."""
    remotes: tuple[Any, ...] = ()
    """Per cache, the :class:`~dataset_rt.fetch.RemoteSource` of a remote cache's local copy
    (None for a cache on disk): each process that reads it fetches its shards on first use."""
    program: _native.Program | None = None
    """The weights of each draw over the run (a schedule, re-weights); None: the plan's own
    table for every draw."""

    def epoch(self, epoch: int) -> _native.Epoch:
        """What every native reader of ``epoch`` opens: the plan, caches, draws and program."""
        return _native.Epoch(
            self.plan,
            list(self.cache_dirs),
            list(self.cache_ids),
            seed=self.seed,
            epoch=epoch,
            verify=self.verify,
            # Records with large out-of-band arrays are not copied into the batch: their
            # arrays view the shard, and collating is their one copy.
            views=self.views,
            program=self.program,
        )

    def batches(
        self, schedule: _native.Schedule, epoch: int, first: int, step: int
    ) -> _native.Prefetcher:
        """Batches ``first, first + step, ...`` of ``schedule``, read ahead on a native thread."""
        for remote in self.remotes:
            if remote is not None:
                remote.attach()  # before the readers open: they fetch their shards through it
        return _native.Prefetcher(self.epoch(epoch), schedule, first, step, self.depth)

    def shard_prefetch(self, schedule: _native.Schedule, epoch: int) -> ShardPrefetch | None:
        """Starts fetching the remote shards ``epoch`` reads ahead of its batches; None if none.

        With a ``local_limit``, the shards fetched ahead stay within half of the smallest.
        """
        if not any(self.remotes):
            return None
        from dataset_rt.transfers import ShardPrefetch

        copies = [None if r is None else r.attach() for r in self.remotes]
        order = _native.epoch_shards(self.epoch(epoch), schedule)
        fetched = [(copy, file, batch) for code, file, batch in order if (copy := copies[code])]
        limits = [r.local_limit for r in self.remotes if r is not None and r.local_limit]
        budget = min(limits) // 2 if limits else None
        return ShardPrefetch(fetched, budget).start()


@dataclass
class LoaderStats:
    """Running counters of a loader, summed over every iteration since it was created.

    Read them during training to see what a stall comes from: a large ``wait_seconds``
    means the consumer waited for batches (native reads without workers; worker output with
    them); the other times say where the batches' preparation went. With workers, decode,
    transform and collate times are summed over all workers, so they can exceed wall time.
    """

    batches: int = 0
    """Batches yielded."""
    samples: int = 0
    """Samples in those batches."""
    bytes_read: int = 0
    """Payload bytes read from the shards for them."""
    wait_seconds: float = 0.0
    """Time the consuming loop spent waiting for the next batch to be read."""
    decode_seconds: float = 0.0
    """Time spent turning records' bytes into records."""
    transform_seconds: float = 0.0
    """Time spent in ``transform``."""
    collate_seconds: float = 0.0
    """Time spent in ``collate``."""
    empty_queue: int = 0
    """Batches for which the native reader had nothing ready (without workers): the
    consumer waited on reading. Near 0 means reading keeps ahead of training."""
    queue_depth_sum: int = 0
    """Sum over batches of the batches ready in the reader's queue when one was taken
    (without workers); ``queue_depth_sum / batches`` is the mean queue depth."""

    def add(self, samples: int, nbytes: int, times: list[float]) -> None:
        """Counts a batch of ``samples`` records of ``nbytes`` whose stages took ``times``.

        ``times`` holds the decode, transform and collate seconds, and is zeroed.
        """
        self.batches += 1
        self.samples += samples
        self.bytes_read += nbytes
        self.decode_seconds += times[0]
        self.transform_seconds += times[1]
        self.collate_seconds += times[2]
        times[0] = times[1] = times[2] = 0.0

    @property
    def mean_queue_depth(self) -> float:
        """Batches ready in the reader's queue, on average, when the consumer took one."""
        return self.queue_depth_sum / self.batches if self.batches else 0.0

    def __str__(self) -> str:
        return (
            f"{self.batches:,} batches, {self.samples:,} samples, "
            f"{self.bytes_read / 1e6:,.1f} MB read; waited {self.wait_seconds:.3f} s "
            f"(queue empty for {self.empty_queue} batches, mean depth "
            f"{self.mean_queue_depth:.1f}), decode {self.decode_seconds:.3f} s, "
            f"transform {self.transform_seconds:.3f} s, collate {self.collate_seconds:.3f} s"
        )


def _apply(
    fn: Callable[[Any], Any], items: list[Any], spec: LoaderSpec, batch: _native.Batch, what: str
) -> list[Any]:
    """``[fn(x) for x in items]`` at C speed; on failure, names the sample that failed.

    After a failure the items are applied again one by one to find the culprit, so ``fn``
    runs twice on the records before it: only on the way to raising the error.
    """
    try:
        return list(map(fn, items))
    except Exception:
        pass
    ids, caches = batch.sample_ids, batch.caches
    out = []
    for i, item in enumerate(items):
        try:
            out.append(fn(item))
        except Exception as exc:
            where = f"sample_id {ids[i]} of cache {spec.cache_names[caches[i]]!r}"
            if what == "decode":
                hint = (
                    "; the record names a class defined in a script's __main__, which only "
                    "that script has: define the class in a module, or cache the records "
                    'with serializer="dill"'
                    if "__main__" in str(exc)
                    else ""
                )
                raise SerializationError(f"decoding {where} failed: {exc!r}{hint}") from exc
            raise TransformError(f"transform failed on {where}: {exc!r}") from exc
    return out  # pragma: no cover - only reached if fn fails once and then succeeds


def decode_batch(batch: _native.Batch, spec: LoaderSpec) -> list[Any]:
    """The records of one native batch, decoded by the loader's decoders."""
    if spec.views:
        try:
            return batch.decode(pickle.loads, spec.decoders[0])
        except Exception:
            # Decode again record by record, to name the one that fails.
            return _apply(spec.decoders[0], batch.views(), spec, batch, "decode")
    if len(spec.decoders) == 1:
        return _apply(spec.decoders[0], batch.records(), spec, batch, "decode")
    decoders = spec.decoders
    pairs = list(zip(batch.caches, batch.records(), strict=True))
    return _apply(lambda p: decoders[p[0]](p[1]), pairs, spec, batch, "decode")


def assemble(batch: _native.Batch, spec: LoaderSpec, times: list[float] | None = None) -> Any:
    """Decodes, transforms and collates the records of one native batch.

    If ``times`` is given, the seconds spent decoding, transforming and collating are added
    to its first three items.
    """
    start = time.perf_counter()
    try:
        records = decode_batch(batch, spec)
        decoded = time.perf_counter()
        if spec.transform is not None:
            records = _apply(spec.transform, records, spec, batch, "transform")
        transformed = time.perf_counter()
        out = spec.collate(records)
    except Exception as exc:
        if batch.shrank:  # what failed read zeros: report that
            raise _shrank(batch, spec) from exc
        raise
    if batch.shrank:  # arrays viewing a shard read zeros where it was truncated
        raise _shrank(batch, spec)
    if times is not None:
        times[0] += decoded - start
        times[1] += transformed - decoded
        times[2] += time.perf_counter() - transformed
    return out


def _shrank(batch: _native.Batch, spec: LoaderSpec) -> CacheCorruptError:
    """The error for a batch whose arrays read zeros from a shard truncated under them."""
    names = ", ".join(sorted({repr(spec.cache_names[c]) for c in batch.caches}))
    return CacheCorruptError(
        f"a file of cache {names} shrank while it was mapped (truncated by another "
        f"process?): batch {batch.number} read zeros from it. Check it with "
        "`dataset-rt verify`, rebuild it if damaged, and open it again"
    )

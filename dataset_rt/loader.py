"""Training loaders spawned from a metadata frame: ``df.drt.loader(...)``."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from dataset_rt import _native
from dataset_rt.errors import ArgumentError, LoaderStateError
from dataset_rt.options import check_draws, check_int, check_same, resolve_ranks
from dataset_rt.pipeline import Collate, LoaderSpec, LoaderStats, Transform, assemble
from dataset_rt.program import Phase, WeightSource, seen_frame
from dataset_rt.reweights import Weights, row_weights
from dataset_rt.roots import PathLike
from dataset_rt.serialize import Decoder, PickleDecoder
from dataset_rt.snapshot import decoder_of, remote_of, take

__all__ = ["Loader", "LoaderStats", "loader_signature"]

STATE_FORMAT = 1


def _default_collate() -> Collate:
    try:
        from dataset_rt.collate import default_collate
    except ImportError:  # no PyTorch (or no NumPy): batches are lists of records
        return list
    return default_collate


class Loader:
    """Batches of decoded records drawn from a metadata frame; see ``df.drt.loader``.

    A loader snapshots its frame when built: later edits of the frame or of the cache's
    metadata do not change it. Iterating a shuffled loader yields this rank's batches of the
    current epoch, from where the last iteration (or :meth:`load_state_dict`) left off;
    iterating again after an epoch ended moves on to the next epoch, so every pass draws anew
    even where nothing calls :meth:`set_epoch` (PyTorch Lightning, a loop that forgets it).
    An evaluation loader (``shuffle=False``) reads every row on every pass: each ``iter()``
    starts at the first row, unless :meth:`load_state_dict` was called just before it.

    Parameters
    ----------
    frame
        A metadata frame with ``cache_id``, ``sample_id`` and (to shuffle) ``weight``
        columns, such as ``cache.metadata`` or any filtered, joined or re-weighted copy.
    batch_size
        Samples per batch on each rank.
    shuffle
        ``True``: each epoch is ``num_samples`` weighted draws with replacement
        (P(row) ∝ ``weight``). ``False``: every row once, in frame order.
    seed
        With the epoch, fixes the draws: the same ``(seed, epoch)`` gives the same
        samples for any ``num_workers`` and ``prefetch``, with or without PyTorch.
    num_samples
        Draws per epoch across all ranks; default the number of rows.
    decode
        Bytes → record; default the decoder matching how each cache was written.
    transform
        Applied to every decoded record.
    collate
        List of records → batch; default PyTorch's ``default_collate`` when PyTorch is
        installed, else the list itself.
    num_workers
        PyTorch DataLoader worker processes decoding in parallel (needs PyTorch).
    prefetch
        Batches read ahead by the native reader thread.
    drop_last
        Drop the positions that do not fill a whole batch on every rank.
    rank, world_size
        This process's share of the global stream; default from
        ``torch.distributed`` when it is initialised, else a single process.
    root
        Where to look for caches this process has not opened yet.
    verify
        Check every record against its stored checksum.
    copy
        Give decoded NumPy arrays their own writable memory. By default (caches written
        with ``serializer="pickle"``) they are read-only views of the mapped shard
        (or of the batch's buffer, for records under 64 KiB), and the default collate
        stacks them into the batch tensor in one copy.
    schedule
        Weights that change with training progress: a list of :class:`Phase`, each
        drawing from its own weights (a column, an expression or one value per row) until
        a global draw count, held constant or blended linearly into the next weights. The
        frame then needs no ``weight`` column. See ``docs/programs.md``.
    history
        Where :meth:`reweight` keeps the weight versions it makes, so that a loader's state
        resumes after them; default ``.weights`` in the first cache's root directory.
    """

    def __init__(
        self,
        frame: pl.DataFrame | pl.LazyFrame,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_samples: int | None = None,
        decode: Decoder | None = None,
        transform: Transform | None = None,
        collate: Collate | None = None,
        num_workers: int = 0,
        prefetch: int = 4,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        root: PathLike | None = None,
        verify: bool = False,
        copy: bool = False,
        schedule: Sequence[Phase] | None = None,
        history: PathLike | None = None,
    ) -> None:
        self._batch_size = check_int("batch_size", batch_size, 1)
        self._num_workers = check_int("num_workers", num_workers, 0)
        prefetch = check_int("prefetch", prefetch, 1)
        seed = check_int("seed", seed, 0, 2**64 - 1)
        self._shuffle = bool(shuffle)
        self._drop_last = bool(drop_last)
        num_samples, phases = check_draws(self._shuffle, num_samples, schedule, self._num_workers)
        self._rank, self._world_size = resolve_ranks(rank, world_size)

        taken = take(self, frame, root, self._shuffle, phases, bool(verify))
        caches, plan, digest, program = taken.caches, taken.plan, taken.digest, taken.program
        self._rows = taken.rows
        # Held for the loader's life: each epoch's native reader shares their mappings of
        # the shards, so pages mapped in one epoch stay mapped for the next.
        self._caches = caches
        self._total = num_samples if num_samples is not None else self._rows
        # The epoch's layout over ranks and batches, built once; `at(cursor)` moves it.
        self._layout = _native.Schedule(
            self._total, 0, self._rank, self._world_size, self._batch_size, self._drop_last
        )

        if collate is None:
            collate = _default_collate()
        decoders = tuple(decoder_of(c, decode, bool(copy)) for c in caches)
        views = all(isinstance(d, PickleDecoder) for d in decoders)
        if views:
            # The same function without the class's Python-level __call__ in between.
            decoders = tuple(d.function for d in decoders)  # type: ignore[attr-defined]

        ids_digest = hashlib.sha256("\n".join(c.cache_id for c in caches).encode()).hexdigest()
        self._fingerprint = f"{digest}-{ids_digest[:16]}"
        if program is not None:
            self._fingerprint += f"-{program.fingerprint[:16]}"
        self._weights = Weights(
            program,
            plan,
            digest,
            self._fingerprint,
            Path(history) if history is not None else caches[0].root / ".weights",
        )
        self._spec = LoaderSpec(
            plan=plan,
            cache_dirs=tuple(str(c.path) for c in caches),
            cache_ids=tuple(c.cache_id for c in caches),
            cache_names=tuple(c.name for c in caches),
            decoders=decoders,
            transform=transform,
            collate=collate,
            seed=seed,
            depth=prefetch,
            verify=bool(verify),
            views=views,
            remotes=tuple(remote_of(c) for c in caches),
            program=self._weights.native,
        )
        self._packed = b""
        self._pack()
        self._epoch = 0
        self._cursor = 0
        # Set by load_state_dict: the next iteration continues from the loaded position,
        # even for an evaluation loader, which otherwise starts over at every iter().
        self._resuming = False
        self._stats = LoaderStats()
        self._opened: _native.Opened | None = None

    def _pack(self) -> None:
        if self._num_workers > 0:
            from dataset_rt.workers import pack

            # Packed here, so that a function workers cannot receive fails now.
            self._packed = pack(self._spec)

    def stats(self) -> LoaderStats:
        """A copy of the loader's running counters: samples, bytes, waits and stage times.

        Counting costs a few clock reads per batch, whether or not the counters are read.

        Examples
        --------
        >>> import dataset_rt as drt
        >>> c = drt.cache(range(100), "doc-stats-example", progress=False)
        >>> loader = c.metadata.drt.loader(batch_size=10, collate=list)
        >>> _ = list(loader)
        >>> loader.stats().samples
        100
        """
        return dataclasses.replace(self._stats)

    # -- epochs and state ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose draws the next iteration yields.

        Calling it is optional: a loader moves to the next epoch by itself when it is
        iterated again after an epoch ended. A loop that calls ``set_epoch(epoch)`` at the
        top of every epoch sees the same draws either way. Setting the epoch the loader is
        in keeps its position mid-epoch, so such a loop resumes mid-epoch after
        :meth:`load_state_dict`; setting an epoch that has ended starts it again.
        """
        epoch = check_int("epoch", epoch, 0, 2**63 - 1)
        if epoch != self._epoch or self._cursor >= self._total:
            self._epoch = epoch
            self._cursor = 0

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch (the same on every rank)."""
        return self._layout.num_batches

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: a small dict of plain values, for ``torch.save``.

        It records the epoch and the first position of the epoch's global stream that no
        rank has consumed, so it resumes at any world size, worker count or batch size.
        After :meth:`reweight`, it also names the newest re-weight in the ``history``
        directory, from which :meth:`load_state_dict` brings every weight version back.
        """
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "epoch": self._epoch,
            "position": self._cursor,
            "seed": self._spec.seed,
            "total": self._total,
            "shuffle": self._shuffle,
            "plan": self._fingerprint,
        }
        return self._weights.stamped(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from a position saved by :meth:`state_dict`, in O(1).

        A state saved after :meth:`reweight` brings its weight versions back from the
        loader's ``history`` directory (each checked against its checksum), whatever this
        loader's own re-weights were.

        Raises
        ------
        LoaderStateError
            The state does not come from a loader over the same rows, weights, schedule,
            seed and epoch length, or its re-weights cannot be found or are damaged. The
            loader is left as it was.
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise LoaderStateError(f"not a dataset_rt loader state: {state!r}")
        check_same(
            state,
            {
                "plan": self._fingerprint,
                "seed": self._spec.seed,
                "total": self._total,
                "shuffle": self._shuffle,
            },
        )
        epoch = check_int("epoch", state["epoch"], 0, 2**63 - 1)
        cursor = check_int("position", state["position"], 0, self._total)
        if self._weights.restore(state.get("history"), self._rows):
            self._weights_changed()
        self._epoch, self._cursor = epoch, cursor
        self._resuming = True

    # -- the weights over the run ---------------------------------------------------------------
    def _weights_changed(self) -> None:
        self._spec = dataclasses.replace(self._spec, program=self._weights.native)
        self._pack()

    def reweight(
        self, weights: WeightSource | pl.DataFrame | pl.LazyFrame, *, step: int | None = None
    ) -> None:
        """Draws by new weights from the next epoch on, or from ``step`` of this epoch.

        Draws before that point are unchanged, so a state saved at any point resumes the
        same stream; everything after that point, later schedule phases included, draws by
        the new weights. Their table is built once and shared with the worker processes; a
        copy goes to the loader's ``history`` directory, where :meth:`load_state_dict` finds
        it again. With several ranks, every rank must re-weight with the same weights at the
        same step. A loader being iterated switches at that point: batches read ahead are
        read again by the new weights.

        Parameters
        ----------
        weights
            One weight per row of the loader's frame, in its order (a Series, list or
            array), or a frame with ``cache_id``, ``sample_id`` and ``weight`` giving every
            row of the loader its weight, such as the metadata joined with per-sample losses.
        step
            A batch of the current epoch (counted from the epoch's start, as
            :meth:`seen` counts) not yet drawn; default the start of the next epoch this
            loader has not begun.

        Raises
        ------
        WeightError
            Negative, NaN, infinite, missing or all-zero weights.
        MetadataError
            A frame with rows the loader does not have, or without a weight for some row.
        ArgumentError
            ``step`` has already been drawn, or the loader does not shuffle.
        """
        if not self._shuffle:
            raise ArgumentError(
                "reweight applies to shuffled loaders; shuffle=False draws no weights"
            )
        start = self._reweight_start(step)
        spec = self._spec
        self._weights.reweight(start, row_weights(weights, spec.plan, spec.cache_ids, self._rows))
        self._weights_changed()

    def _reweight_start(self, step: int | None) -> int:
        first = self._epoch * self._total
        if step is None:
            # The next epoch not begun: this one while nothing of it is consumed.
            return first + (self._total if self._cursor > 0 else 0)
        step = check_int("step", step, 0)
        position = step * self._batch_size * self._world_size
        if position < self._cursor:
            raise ArgumentError(
                f"step {step} of epoch {self._epoch} has been drawn already (the loader is at "
                f"position {self._cursor}): re-weight at a later step, or at the next epoch"
            )
        if position >= self._total:
            raise ArgumentError(
                f"step {step} is past the end of the epoch ({len(self)} steps); leave step "
                "out to re-weight from the next epoch"
            )
        return first + position

    def seen(
        self, steps: int | range | None = None, *, epoch: int | None = None, all_ranks: bool = False
    ) -> pl.DataFrame:
        """What the model sees (or saw) in steps of an epoch, from the program alone.

        One row per draw: ``epoch, step, rank, position, cache_id, sample_id, phase,
        version``, where ``position`` is the draw's place in the epoch's global stream,
        ``phase`` the schedule phase it falls in (``"reweight"`` after a re-weight) and
        ``version`` the number of re-weights in force (0 before any). Steps are this rank's
        batches counted from the start of the epoch at the loader's batch size and world
        size; no payload is read. Join it with the metadata on ``cache_id, sample_id`` to
        count exposure per source, or pass a step's ``sample_id`` to ``cache.get_many`` to
        replay its batch.

        Parameters
        ----------
        steps
            A step or a ``range`` of steps; default every step of the epoch.
        epoch
            Default the loader's current epoch.
        all_ranks
            Every rank's draws, not only this rank's.
        """
        layout = self._layout
        epoch = self._epoch if epoch is None else epoch
        return seen_frame(self._spec, layout, self._weights.program, epoch, steps, all_ranks)

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self._rollover()
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # A re-weight during iteration changes the draws from some point on: the batches
        # read ahead are dropped and reading starts again, from the position reached, by
        # the new weights (the draws before that point are the same under both).
        while True:
            spec = self._spec
            batches = self._batches()
            try:
                for batch in batches:
                    yield batch
                    if self._spec is not spec:
                        break
                else:
                    return
            finally:
                batches.close()

    def _rollover(self) -> None:
        resuming, self._resuming = self._resuming, False
        if self._cursor >= self._total:
            # A finished epoch moves on to the next one, as a shuffling PyTorch DataLoader
            # draws a new order on every pass: epoch e's state at its end resumes in e + 1.
            self._epoch += 1
            self._cursor = 0
        elif not self._shuffle and not resuming:
            # An evaluation pass reads every row: one that stopped early (Lightning's sanity
            # check takes two batches) is not continued by the next iter(), which starts over.
            self._cursor = 0

    def _batches(self) -> Generator[Any, None, None]:
        """Batches of this rank's epoch from the cursor on, with the current weights."""
        schedule = self._layout.at(self._cursor)
        if self._num_workers == 0:
            batches: Iterator[Any] = self._local(schedule)
        else:
            from dataset_rt.workers import counted, worker_batches

            batches = counted(
                worker_batches(
                    self._packed, schedule, self._epoch, self._num_workers, self._spec.depth
                ),
                self._stats,
            )
        return self._counted(schedule, batches)

    def _local(self, schedule: _native.Schedule) -> Iterator[Any]:
        spec, stats = self._spec, self._stats
        times = [0.0, 0.0, 0.0]
        prefetcher = spec.batches(schedule, self._epoch, 0, 1)
        # Kept until the next epoch's reader opens the same files: it then shares their
        # mappings, with the pages of the plan and the index this epoch touched.
        self._opened = prefetcher.opened
        while True:
            ready = prefetcher.ready
            start = time.perf_counter()
            batch = next(prefetcher, None)
            stats.wait_seconds += time.perf_counter() - start
            if batch is None:
                return
            stats.queue_depth_sum += ready
            stats.empty_queue += int(ready == 0)
            out = assemble(batch, spec, times)
            stats.add(len(batch), batch.nbytes, times)
            yield out

    def _counted(
        self, schedule: _native.Schedule, batches: Iterator[Any]
    ) -> Generator[Any, None, None]:
        consumed = 0
        shards = None
        try:
            shards = self._spec.shard_prefetch(schedule, self._epoch)
            for batch in batches:
                consumed += 1
                self._cursor = schedule.cursor_after(consumed)
                if shards is not None:
                    shards.advance(consumed)
                yield batch
            # Every rank's share is read: the epoch has ended, even where what was left of
            # it filled no batch (drop_last, or a resume at another batch size).
            self._cursor = self._total
        finally:
            if shards is not None:
                shards.stop()
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def __repr__(self) -> str:
        return (
            f"Loader(rows={self._rows:,}, batch_size={self._batch_size}, "
            f"shuffle={self._shuffle}, epoch={self._epoch}, position={self._cursor}/"
            f"{self._total}, rank={self._rank}/{self._world_size}, "
            f"num_workers={self._num_workers})"
        )


def loader_signature() -> inspect.Signature:
    """``Loader``'s options as a method signature: ``(self, batch_size, *, shuffle=True, ...)``.

    ``df.drt.loader`` forwards its options to :class:`Loader`; this is what it shows.
    """
    init = inspect.signature(Loader.__init__)
    params = [p for name, p in init.parameters.items() if name != "frame"]
    return init.replace(parameters=params)

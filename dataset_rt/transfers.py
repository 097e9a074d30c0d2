"""Transfers on threads: many objects under one progress line, and a loader's shards ahead.

:func:`in_parallel` moves a list of objects (``push``, ``pull``, fetching a whole copy);
:class:`ShardPrefetch` fetches the shards an epoch reads ahead of the batches that read them.
Object stores serve requests in parallel and each waits on the network far more than on this
machine (obstore releases the GIL), so both keep :data:`IN_FLIGHT` transfers running.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from dataset_rt.objects import Cancelled
from dataset_rt.progress import BuildProgress


class ShardCopy(Protocol):
    """What :class:`ShardPrefetch` needs of a remote cache's local copy (``fetch.LocalCopy``)."""

    shards: dict[str, tuple[int, str]]
    """Each shard's size and checksum, by file."""

    def present(self, file: str) -> bool:
        """Whether ``file`` is in the copy already."""
        ...

    def fetch(self, file: str, stop: threading.Event | None = None) -> None:
        """Downloads ``file`` into the copy, unless ``stop`` is set first."""
        ...


__all__ = ["IN_FLIGHT", "ShardPrefetch", "in_parallel"]

# Shard downloads in flight at once, per process: object stores serve requests in parallel,
# and each waits on the network far more than on this machine (obstore releases the GIL).
IN_FLIGHT = 8


T = TypeVar("T")


def in_parallel(
    items: Sequence[T], transfer: Callable[[T], int], label: str, progress: bool
) -> None:
    """Runs ``transfer(item)`` for every item, ``IN_FLIGHT`` at a time, with one progress line.

    ``transfer`` returns the bytes it moved. The first failure cancels what has not started
    and is raised.
    """
    moved = [0]
    bar = BuildProgress(label, nbytes=lambda: moved[0], enabled=progress, total=len(items))
    ok = False
    try:
        with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="drt-transfer") as pool:
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


@dataclass
class ShardPrefetch:
    """Fetches the shards a loader's epoch reads ahead of the batches that read them.

    ``order`` lists ``(copy, file, batch)``: each shard once, in the order batches first
    need it. Up to :data:`IN_FLIGHT` downloads run at once; with a ``local_limit``, the
    shards fetched but not yet needed stay within half of it, so that eviction never
    deletes what the next batches read.
    """

    order: list[tuple[ShardCopy, str, int]]
    budget: int | None
    position: int = 0
    """Batches consumed so far; the loader moves it on."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _moved: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None
    errors: list[Exception] = field(default_factory=list)
    """What failed ahead of the reads; the reader fetched those shards itself."""

    def start(self) -> ShardPrefetch:
        """Starts fetching on a thread of its own; returns itself."""
        self._thread = threading.Thread(target=self._run, name="drt-shard-prefetch", daemon=True)
        self._thread.start()
        return self

    def advance(self, position: int) -> None:
        """Records that ``position`` batches were consumed."""
        with self._moved:
            self.position = position
            self._moved.notify_all()

    def stop(self) -> None:
        """Stops fetching; downloads already running finish."""
        self._stop.set()
        with self._moved:
            self._moved.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        batches = [batch for _, _, batch in self.order]  # non-decreasing
        ends = [0]  # ends[i]: bytes of the first i shards of the order
        for copy, file, _ in self.order:
            ends.append(ends[-1] + copy.shards[file][0])
        running: list[Future[None]] = []
        with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="drt-fetch") as pool:
            for i, (copy, file, _) in enumerate(self.order):
                with self._moved:
                    while not self._stop.is_set() and not self._may_fetch(i, batches, ends):
                        self._moved.wait(0.5)
                while len(running) >= IN_FLIGHT and not self._stop.is_set():
                    futures.wait(running, return_when=futures.FIRST_COMPLETED)
                    running = [f for f in running if not f.done()]
                if self._stop.is_set():
                    break
                if not copy.present(file):
                    running.append(pool.submit(self._fetch, copy, file))
            # Running downloads see the stop flag between chunks; waiting ones never start.
            pool.shutdown(wait=True, cancel_futures=True)

    def _fetch(self, copy: ShardCopy, file: str) -> None:
        try:
            copy.fetch(file, self._stop)
        except Cancelled:
            pass
        except Exception as exc:  # the reader fetches the shard again, and raises
            self.errors.append(exc)

    def _may_fetch(self, i: int, batches: list[int], ends: list[int]) -> bool:
        """Whether shard ``i`` of the order may be fetched now.

        It may if a consumed batch needs it, or if it fits in the budget with the shards
        before it that unconsumed batches need.
        """
        if self.budget is None or batches[i] <= self.position:
            return True
        first_ahead = bisect.bisect_right(batches, self.position)
        return ends[i + 1] - ends[first_ahead] <= self.budget

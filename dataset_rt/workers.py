"""The loader's worker path: PyTorch DataLoader workers, each reading its share of batches.

Worker ``w`` of ``W`` reads batches ``w, w + W, w + 2W, ...`` of the rank's schedule with its
own native prefetch thread, decodes, transforms and collates them, and sends back the
collated batch: its tensors through segments of shared memory that the worker reuses and
the main process maps once (:mod:`dataset_rt.ring`). The DataLoader takes one
batch from each worker in turn, so batches arrive in the same order as without workers.

How workers start, and why:

- Never by plain ``fork``: a child forked from a process whose Polars thread pool has run
  can deadlock. Workers fork from a ``forkserver`` (``spawn`` where there is none) that has
  already imported PyTorch and dataset_rt, so each epoch's workers start in milliseconds.
- Without running the user's main module again. ``multiprocessing`` normally re-executes a
  script's ``__main__`` in every child it does not fork from the parent; a script without
  an ``if __name__ == "__main__":`` guard would then build a loader, start processes or join
  a ``torch.distributed`` group inside each worker, and fail or wait forever. The workers
  need nothing from ``__main__``: ``decode``, ``transform`` and ``collate`` travel to them
  with cloudpickle, by reference when they can be imported and by value when they live in
  ``__main__``, a notebook cell or a function body.
- Within a bounded time. Each worker reports that it started before reading; a worker that
  has not done so after :data:`START_TIMEOUT` seconds is a :class:`WorkerError`, and a
  worker that dies is reported by PyTorch within seconds.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.context
import multiprocessing.popen_forkserver
import multiprocessing.popen_spawn_posix
import multiprocessing.spawn
import os
import pickle
import select
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.utils.data as tud

from dataset_rt import _native
from dataset_rt.errors import ArgumentError, WorkerError
from dataset_rt.pipeline import LoaderSpec, LoaderStats, assemble
from dataset_rt.processes import ForkServerContext, SpawnContext
from dataset_rt.ring import MainRing, WorkerRing, set_worker_ring

__all__ = ["DEFAULT_START_TIMEOUT", "pack", "run_workers", "start_timeout", "worker_batches"]

START_TIMEOUT_VARIABLE = "DATASET_RT_WORKER_START_TIMEOUT"
DEFAULT_START_TIMEOUT = 120.0
"""Seconds a worker process may take to start before the loader gives up on it, unless
``$DATASET_RT_WORKER_START_TIMEOUT`` says otherwise (read each time workers start)."""

_STARTED = "dataset_rt: worker started"
_START_POLL = 2.0
"""Seconds between checks for dead workers while waiting for workers to start."""


def pack(spec: LoaderSpec) -> bytes:
    """``spec`` as bytes a worker can load without the parent's ``__main__`` module.

    Raises
    ------
    ArgumentError
        ``decode``, ``transform`` or ``collate`` cannot be sent to another process (it holds
        a lock, an open file, a generator, ...).
    """
    try:
        return bytes(cloudpickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:
        culprit = next(
            (
                f"{name}={fn!r}"
                for name, fn in (
                    ("transform", spec.transform),
                    ("collate", spec.collate),
                    ("decode", spec.decoders),
                )
                if not _pickles(fn)
            ),
            "the loader's functions",
        )
        raise ArgumentError(
            f"{culprit} cannot be sent to worker processes ({exc}); use num_workers=0, or a "
            "function that does not hold locks, open files or other per-process state"
        ) from exc


def start_timeout() -> float:
    """The seconds workers may take to start: ``$DATASET_RT_WORKER_START_TIMEOUT`` or 120.

    Raises
    ------
    ArgumentError
        The variable is set to something other than a positive number of seconds.
    """
    text = os.environ.get(START_TIMEOUT_VARIABLE)
    if text is None:
        return DEFAULT_START_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ArgumentError(
            f"{START_TIMEOUT_VARIABLE}={text!r} must be a positive number of seconds"
        )
    return seconds


def _pickles(obj: Any) -> bool:
    try:
        cloudpickle.dumps(obj)
    except Exception:
        return False
    return True


def _keep(batch: Any) -> Any:
    return batch


_watching: set[int] = set()


def _exit_with(pid: int) -> None:
    """Ends this worker process when the loader's process ``pid`` ends, however it ends.

    PyTorch's workers watch their parent process; a fork server's workers have the fork
    server as their parent, and it outlives a loader's process that is killed (the OOM
    killer, a preempted job) for as long as any worker lives: without this watch, workers
    and fork server would wait for work that never comes, forever.
    """
    if pid in _watching:
        return
    _watching.add(pid)

    def watch() -> None:
        try:
            handle = os.pidfd_open(pid)
        except OSError:  # the process is gone already, or the kernel predates pidfds
            handle = -1
        if handle >= 0:
            select.select([handle], [], [])  # readable once the process has ended
        else:
            while Path(f"/proc/{pid}").exists():
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="dataset_rt: exit with the loader", daemon=True).start()


class _WorkerStream(tud.IterableDataset[Any]):
    def __init__(
        self, packed: bytes, schedule: _native.Schedule, epoch: int, flags: torch.Tensor
    ) -> None:
        self.packed = packed
        self.schedule = schedule
        self.epoch = epoch
        self.flags = flags
        self.loader_pid = os.getpid()

    def __iter__(self) -> Iterator[Any]:
        _exit_with(self.loader_pid)
        # Loaded here rather than when the process starts, so that a function that cannot be
        # loaded in the worker is an exception the DataLoader re-raises in the main process.
        spec: LoaderSpec = pickle.loads(self.packed)
        yield _STARTED
        info = tud.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # The DataLoader already keeps prefetch_factor collated batches per worker in flight;
        # a native read-ahead of one batch overlaps reading with decoding. A deeper one would
        # only hold more batch buffers per worker.
        spec = dataclasses.replace(spec, depth=1)
        ring = WorkerRing(self.flags, worker)
        set_worker_ring(ring)
        try:
            for batch in spec.batches(self.schedule, self.epoch, worker, workers):
                times = [0.0, 0.0, 0.0]
                out = ring.pack(assemble(batch, spec, times))
                # The counters travel with the batch, for the main process's loader.stats().
                yield out, len(batch), batch.nbytes, times
        finally:
            set_worker_ring(None)


class _Produced(tud.IterableDataset[Any]):
    """Each worker's share of what ``produce(worker, workers)`` yields."""

    def __init__(self, produce: Callable[[int, int], Iterator[Any]]) -> None:
        self.produce = produce
        self.loader_pid = os.getpid()

    def __iter__(self) -> Iterator[Any]:
        _exit_with(self.loader_pid)
        yield _STARTED
        info = tud.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        yield from self.produce(worker, workers)


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return SpawnContext()
    context = ForkServerContext()
    # Workers fork from a server that has already imported PyTorch and this module, so each
    # epoch's workers start in milliseconds instead of importing PyTorch again. (This only
    # takes effect if the process's fork server is not running yet.)
    context.set_forkserver_preload(["torch", "dataset_rt.workers"])
    return context


def worker_batches(
    packed: bytes, schedule: _native.Schedule, epoch: int, num_workers: int, depth: int
) -> Iterator[Any]:
    """Yields the rank's batches from ``schedule``, read by ``num_workers`` processes.

    ``packed`` is the loader's spec from :func:`pack`; ``depth`` the batches to keep in flight.
    Each item is ``(batch, samples, bytes, stage times)``.
    """
    ring = MainRing(num_workers)
    items = _run(_WorkerStream(packed, schedule, epoch, ring.flags), num_workers, depth)
    try:
        for message, *counts in items:
            yield ring.unpack(message), *counts
    finally:
        items.close()


def counted(
    batches: Iterator[tuple[Any, int, int, list[float]]], stats: LoaderStats
) -> Iterator[Any]:
    """The batches of the workers' ``(batch, samples, bytes, stage times)``, counted in ``stats``.

    Closing it shuts the workers down (a consumer that stops early).
    """
    try:
        while True:
            start = time.perf_counter()
            item = next(batches, None)
            stats.wait_seconds += time.perf_counter() - start
            if item is None:
                return
            out, samples, nbytes, times = item
            stats.add(samples, nbytes, times)
            yield out
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def run_workers(
    produce: Callable[[int, int], Iterator[Any]], num_workers: int, depth: int
) -> Iterator[Any]:
    """Yields what ``produce(w, num_workers)`` yields in worker processes ``w``, in turn.

    ``produce`` travels to the workers by pickle; worker ``w`` yields every
    ``num_workers``-th item from item ``w`` on, so that taking one item from each worker
    in turn gives them in order. ``depth`` is the items to keep in flight.
    """
    return _run(_Produced(produce), num_workers, depth)


def _run(
    stream: tud.IterableDataset[Any], num_workers: int, depth: int
) -> Generator[Any, None, None]:
    """Yields ``stream``'s items (after each worker's start report) from its processes."""
    loader = tud.DataLoader(
        stream,
        batch_size=None,
        collate_fn=_keep,
        num_workers=num_workers,
        multiprocessing_context=_context(),
        prefetch_factor=max(1, -(-depth // num_workers)),
        persistent_workers=False,
    )
    timeout = start_timeout()
    # Until every worker has reported, wait for items in short slices: between slices
    # PyTorch checks that no worker died, and the start deadline is checked here.
    deadline = time.monotonic() + timeout
    iterator: Any = None
    started = 0
    try:
        iterator = iter(loader)  # launches the workers
        iterator._timeout = min(_START_POLL, timeout)
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                return
            except RuntimeError as exc:
                message = str(exc)
                if type(exc) is RuntimeError and message.startswith("DataLoader timed out"):
                    if started < num_workers and time.monotonic() < deadline:
                        continue  # PyTorch's iterator is unchanged by a timeout: wait again
                    raise WorkerError(
                        f"{num_workers - started} of {num_workers} loader worker processes "
                        f"did not start within {timeout:g} s (set {START_TIMEOUT_VARIABLE} "
                        "to wait longer, or use num_workers=0)"
                    ) from exc
                if type(exc) is RuntimeError and "exited unexpectedly" in message:
                    raise WorkerError(message) from exc
                raise
            except (ConnectionError, EOFError, FileNotFoundError) as exc:
                # A worker killed just after queueing a batch leaves a tensor whose file
                # descriptor can no longer be fetched: PyTorch then surfaces the broken
                # connection instead of its "worker exited unexpectedly" error.
                dead = _dead_workers(iterator)
                if not dead:
                    raise
                raise WorkerError(
                    f"DataLoader worker ({dead}) exited unexpectedly while sending a batch"
                ) from exc
            if isinstance(item, str) and item == _STARTED:
                started += 1
                if started == num_workers:
                    # Every worker runs: from here on a batch may take as long as the user's
                    # transform needs. PyTorch still reports a worker that dies.
                    iterator._timeout = 0
                continue
            yield item
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def _dead_workers(iterator: Any) -> str:
    """Names the loader's workers that have died, or is empty if none has."""
    dead = []
    for process in getattr(iterator, "_workers", []):
        process.join(timeout=1.0)  # reaps a worker that was killed a moment ago
        if process.exitcode is not None and process.exitcode != 0:
            dead.append(f"pid {process.pid}, exit code {process.exitcode}")
    return "; ".join(dead)

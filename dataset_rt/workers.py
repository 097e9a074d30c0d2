"""The loader's worker path: PyTorch DataLoader workers, each reading its share of batches.

Worker ``w`` of ``W`` reads batches ``w, w + W, w + 2W, ...`` of the rank's schedule with its
own native prefetch thread, decodes, transforms and collates them, and sends back the
collated batch (PyTorch moves tensors through shared memory). The DataLoader takes one
batch from each worker in turn, so batches arrive in the same order as without workers.

Workers are started with ``forkserver`` (or ``spawn`` where that is missing), never plain
``fork``: a child forked from a process whose Polars thread pool has run can deadlock.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Iterator
from typing import Any

import torch.utils.data as tud

from dataset_rt import _native
from dataset_rt.loader import LoaderSpec, assemble

__all__ = ["worker_batches"]


def _keep(batch: Any) -> Any:
    return batch


class _WorkerStream(tud.IterableDataset[Any]):
    def __init__(self, spec: LoaderSpec, schedule: _native.Schedule, epoch: int) -> None:
        self.spec = spec
        self.schedule = schedule
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        info = tud.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # The DataLoader already keeps prefetch_factor collated batches per worker in flight;
        # a native read-ahead of one batch overlaps reading with decoding. A deeper one would
        # only hold more batch buffers per worker.
        spec = dataclasses.replace(self.spec, depth=1)
        for batch in spec.stream(self.schedule, self.epoch, worker, workers):
            times = [0.0, 0.0, 0.0]
            out = assemble(batch, spec, times)
            # The counters travel with the batch, for the main process's loader.stats().
            yield out, len(batch), batch.nbytes, times


def _context() -> Any:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # Workers fork from a server that has already imported PyTorch and this module, so each
    # epoch's workers start in milliseconds instead of importing PyTorch again. (This only
    # takes effect if the process's fork server is not running yet.)
    context.set_forkserver_preload(["torch", "dataset_rt.workers"])
    return context


def worker_batches(
    spec: LoaderSpec, schedule: _native.Schedule, epoch: int, num_workers: int
) -> Iterator[Any]:
    """Yields the rank's batches from ``schedule``, read by ``num_workers`` processes."""
    loader = tud.DataLoader(
        _WorkerStream(spec, schedule, epoch),
        batch_size=None,
        collate_fn=_keep,
        num_workers=num_workers,
        multiprocessing_context=_context(),
        prefetch_factor=max(1, -(-spec.depth // num_workers)),
        persistent_workers=False,
    )
    iterator = iter(loader)
    try:
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                return
            except (ConnectionError, EOFError, FileNotFoundError) as exc:
                # A worker killed just after queueing a batch leaves a tensor whose file
                # descriptor can no longer be fetched: PyTorch then surfaces the broken
                # connection instead of its "worker exited unexpectedly" error.
                dead = _dead_workers(iterator)
                if not dead:
                    raise
                raise RuntimeError(
                    f"DataLoader worker ({dead}) exited unexpectedly while sending a batch"
                ) from exc
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

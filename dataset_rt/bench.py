"""Measure a loader on your own cache: ``dataset-rt bench NAME`` and :func:`bench`.

Three stages are timed separately over the same weighted draws, each including the stages
before it: raw reads of the records' bytes (the Rust prefetch path), decoding them with the
cache's decoder, and the whole loader (decode, transform-free collate) at several worker
counts. Comparing the rates says which stage limits training throughput.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dataset_rt.caches import open as open_cache
from dataset_rt.errors import ArgumentError
from dataset_rt.loader import Loader
from dataset_rt.pipeline import decode_batch
from dataset_rt.progress import format_bytes
from dataset_rt.roots import PathLike

__all__ = ["BenchResult", "Stage", "bench"]


@dataclass(frozen=True)
class Stage:
    """One measured stage: what ran, how many samples and bytes, in how many seconds."""

    name: str
    samples: int
    nbytes: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        """Samples per second."""
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes per second."""
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class BenchResult:
    """The stages measured by :func:`bench` and the verdict drawn from them."""

    name: str
    stages: list[Stage]
    bottleneck: str
    """``"I/O"``, ``"decode"`` or ``"collate"``: the stage that limits the loader."""
    advice: str

    def table(self) -> str:
        """The stages as an aligned text table."""
        lines = [f"{'stage':<26}{'samples/s':>14}{'MB/s':>10}{'samples':>10}{'seconds':>9}"]
        for s in self.stages:
            lines.append(
                f"{s.name:<26}{s.samples_per_s:>14,.0f}{s.bytes_per_s / 1e6:>10,.1f}"
                f"{s.samples:>10,}{s.seconds:>9.2f}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"{self.table()}\n\nbottleneck: {self.bottleneck}. {self.advice}"


def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _verdict(raw: Stage, decoded: Stage, loader: Stage, *, has_torch: bool) -> tuple[str, str]:
    # Each stage includes the ones before it, so the time a stage adds is the difference of
    # per-sample times. Timing noise can make a later stage faster than an earlier one: a
    # stage never costs less than nothing, and shares are of the stages' sum.
    per = [1 / max(s.samples_per_s, 1e-9) for s in (raw, decoded, loader)]
    costs = {
        "I/O": per[0],
        "decode": max(per[1] - per[0], 0.0),
        "collate": max(per[2] - per[1], 0.0),
    }
    worst = max(costs, key=lambda k: costs[k])
    total = sum(costs.values())
    share = costs[worst] / total if total > 0 else 0.0
    parallel = (
        "Use more workers (num_workers) to decode in parallel"
        if has_torch
        else "Install PyTorch to decode in worker processes (num_workers)"
    )
    advice = {
        "I/O": (
            "Reading the records' bytes takes most of the time: the data are not in the page "
            "cache or the disk is slow. Keep the cache on local SSD, or give the machine "
            "enough RAM to hold it; more workers will not help much."
        ),
        "decode": (
            f"Decoding the bytes into records takes most of the time. {parallel}, or store "
            "records in a cheaper form (arrays rather than many small Python objects)."
        ),
        "collate": (
            "Collating decoded records into batches takes most of the time. Return fewer, "
            "larger arrays per record, or pass a collate function suited to your records."
        ),
    }[worst]
    return worst, f"It takes {share:.0%} of the time per sample without workers. {advice}"


def bench(
    name: str,
    *,
    root: PathLike | None = None,
    samples: int = 20_000,
    batch_size: int = 64,
    workers: Sequence[int] | None = None,
    seed: int = 0,
) -> BenchResult:
    """Measures raw reads, decoding and the loader on cache ``name``.

    Every stage reads the same ``samples`` weighted draws of the live metadata, after one
    untimed warm-up pass that brings the records into the page cache (figures are for a
    warm cache).

    Parameters
    ----------
    name
        The cache's name.
    root
        The directory holding the caches.
    samples
        Draws per measured pass.
    batch_size
        Samples per batch.
    workers
        Worker counts to measure the loader at; counts above 0 need PyTorch. By default 0
        and 2 where PyTorch is installed, else 0 alone (the result says so).
    seed
        Seed of the draws.

    Examples
    --------
    >>> import dataset_rt as drt
    >>> from dataset_rt.bench import bench
    >>> _ = drt.cache([{"x": i} for i in range(500)], "doc-bench-example", progress=False)
    >>> result = bench("doc-bench-example", samples=500, workers=[0])
    >>> [s.name for s in result.stages]
    ['raw reads', 'reads + decode', 'loader, 0 workers']
    """
    if samples < 1 or batch_size < 1:
        raise ArgumentError(f"samples and batch_size must be positive, got {samples}, {batch_size}")
    has_torch = _torch_installed()
    if workers is None:
        counts = [0, 2] if has_torch else [0]
    else:
        counts = sorted({int(w) for w in workers})
        if any(w < 0 for w in counts) or not counts:
            raise ArgumentError(f"workers must be counts >= 0, got {list(workers)}")
        if not has_torch and counts != [0]:
            raise ArgumentError(
                f"workers={list(workers)}: loaders with workers run PyTorch DataLoader "
                "workers, and PyTorch is not installed (pip install torch, or measure 0)"
            )
    cache = open_cache(name, root=root)
    frame = cache.metadata

    def loader(num_workers: int) -> Loader:
        return Loader(
            frame, batch_size, seed=seed, num_samples=samples, num_workers=num_workers, root=root
        )

    probe = loader(0)
    spec = probe._spec

    def native_pass(decoding: bool) -> tuple[int, int]:
        n = nbytes = 0
        for batch in spec.batches(probe._layout, 0, 0, 1):
            if decoding:
                decode_batch(batch, spec)
            n += len(batch)
            nbytes += batch.nbytes
        return n, nbytes

    native_pass(False)  # warm-up: page cache and allocator
    stages = []
    for label, decoding in (("raw reads", False), ("reads + decode", True)):
        start = time.perf_counter()
        n, nbytes = native_pass(decoding)
        stages.append(Stage(label, n, nbytes, time.perf_counter() - start))
    total_bytes = stages[0].nbytes
    for w in counts:
        measured = loader(w)
        if w > 0:
            for _ in measured:  # warm-up: worker start-up is not throughput
                pass
        start = time.perf_counter()
        for _ in measured:
            pass
        stages.append(
            Stage(f"loader, {w} workers", samples, total_bytes, time.perf_counter() - start)
        )
    best_loader = max(stages[2:], key=lambda s: s.samples_per_s)
    bottleneck, advice = _verdict(stages[0], stages[1], stages[2], has_torch=has_torch)
    if best_loader is not stages[2]:
        advice += (
            f" With workers the loader reaches {best_loader.samples_per_s:,.0f} samples/s "
            f"({best_loader.name})."
        )
    if not has_torch:
        advice += " PyTorch is not installed: loaders with workers were not measured."
    return BenchResult(cache.name, stages, bottleneck, advice)


def describe(result: BenchResult) -> str:
    """A heading, the table and the verdict, as the command line prints them."""
    head = f"cache {result.name!r} (warm page cache; each stage includes the ones above it)"
    total = result.stages[0]
    return f"{head}\n{result}\n\nread {total.samples:,} samples, {format_bytes(total.nbytes)}"

"""Random access from a user's own Dataset: ``cache.get`` and ``cache.get_many``.

For the small (3 KB) and large (256 KiB image) records of bench/run.py, reads the same
uniformly random ids, decoded to dicts with a NumPy image, and prints samples/s beside the
``mmap`` baseline of the same run (one flat file of pickles, NumPy offsets, ``mmap`` slices):

- ``mmap, one by one``: ``pickle.loads(mm[start:end])`` per id: the baseline of every ratio;
- ``get, one by one``: ``cache.get(i)`` per id, what ``Dataset.__getitem__`` does;
- ``get_many, 256 ids``: ``cache.get_many(ids)``, what ``DataLoader`` asks of
  ``Dataset.__getitems__``;
- ``loader stream``: the cache's own loader (one process, ``collate=list``) reading as many
  draws, the figure ``get_many`` should reach.

Every figure is the median of --rounds passes after a warm-up pass (warm page cache). The
passes run in alternation, round by round, and a ratio is the median of the ratios within a
round, so that the machine's drift during the run moves both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measuring import paired
from peers import BATCH, DatasetRT, MmapOffsets, Workload
from run import SMOKE, WORKLOADS

import dataset_rt as drt


def rate(count: int, fn: Callable[[], None]) -> Callable[[], float]:
    """A call of ``fn`` (which reads ``count`` samples) that returns its samples/s."""

    def run() -> float:
        start = time.perf_counter()
        fn()
        return count / (time.perf_counter() - start)

    return run


def workload(wl: Workload, root: Path, rounds: int) -> None:
    mmap_dir, drt_dir = root / f"{wl.name}-mmap", root / f"{wl.name}-drt"
    MmapOffsets().build(wl, mmap_dir)
    DatasetRT().build(wl, drt_dir)
    mm, offsets, _ = MmapOffsets().open(mmap_dir)
    cache = drt.open("bench", root=drt_dir)
    ids = np.random.default_rng(3).integers(0, wl.records, size=wl.draws)
    listed = ids.tolist()
    starts, ends = offsets[ids].tolist(), offsets[ids + 1].tolist()
    batches = [listed[i : i + BATCH] for i in range(0, len(listed), BATCH)]

    def mmap_pass() -> None:
        for s, e in zip(starts, ends, strict=True):
            pickle.loads(mm[s:e])

    def get_pass() -> None:
        get = cache.get
        for i in listed:
            get(i)

    def get_many_pass() -> None:
        for batch in batches:
            cache.get_many(batch)

    frame = cache.metadata

    def loader_pass() -> None:
        loader = frame.drt.loader(batch_size=BATCH, num_samples=len(listed), collate=list)
        for _ in loader:
            pass

    print(f"== {wl.records:,} records of {wl.record_bytes():,} B, {len(listed):,} reads ==")
    passes = [
        ("mmap, one by one (baseline)", mmap_pass),
        ("get, one by one", get_pass),
        (f"get_many, {BATCH} ids", get_many_pass),
        ("loader stream, collate=list", loader_pass),
    ]
    for r in paired([(label, rate(len(listed), fn)) for label, fn in passes], rounds):
        print(f"  {r.label:<32}{r.median:>12,.0f} samples/s ±{r.spread:>10,.0f}  {r.ratio:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check it runs")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else WORKLOADS
    print(
        f"machine: {len(os.sched_getaffinity(0))} cores, Python {sys.version.split()[0]}, "
        f"dataset_rt {drt.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="drt-bench-access-") as tmp:
        for name in ("small", "large"):
            spec = sizes[name]
            wl = Workload(name, spec["records"], spec["shape"], spec["draws"])
            workload(wl, Path(tmp), 1 if args.smoke else args.rounds)


if __name__ == "__main__":
    main()

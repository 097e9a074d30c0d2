"""Zero-copy arrays: decode + collate throughput of large-array records.

For records holding one large NumPy array, measures in one process, on the consumer side of
a loader (warm page cache, batch 32):

- ``bare copy``: ``np.stack`` of the same arrays, already in RAM, into a preallocated batch —
  the physical limit of building a batch (the baseline);
- ``zero-copy (default)``: a loader over a cache written with the default serializer: arrays
  decode as views of the mapped shard and are stacked into the batch tensor once;
- ``pickle in band``: a loader over the same records written with ``"pickle-inband"``:
  ``pickle.loads`` copies each array out, PyTorch's collate copies it again.

Prints MB/s with the ratio to the bare copy of the same round (median of the rounds and the
spread). The target (zero-copy issue) is zero-copy within 1.5x of the bare copy's time, i.e. a
throughput ratio of at least 0.67.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import dataset_rt as drt

BATCH = 32


def rate(nbytes: int, fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e6


def workload(records: int, array_kb: int, rounds: int, root: str) -> None:
    rng = np.random.default_rng(0)
    side = int((array_kb * 1024 / 4) ** 0.5)
    arrays = [rng.random((side, side), dtype=np.float32) for _ in range(records)]
    nbytes = sum(a.nbytes for a in arrays)
    name = f"{array_kb}kb"
    oob = drt.cache(({"x": a} for a in arrays), f"{name}-oob", root=root, progress=False)
    inband = drt.cache(
        ({"x": a} for a in arrays),
        f"{name}-inband",
        root=root,
        serializer="pickle-inband",
        progress=False,
    )
    out = np.empty((BATCH, side, side), dtype=np.float32)

    def bare() -> None:
        for i in range(0, records - BATCH + 1, BATCH):
            np.stack(arrays[i : i + BATCH], out=out)

    def through(cache: drt.Cache) -> Callable[[], None]:
        loader = cache.metadata.drt.loader(batch_size=BATCH, shuffle=False, drop_last=True)

        def run() -> None:
            for batch in loader:
                assert batch["x"].shape[0] == BATCH

        return run

    used = (records // BATCH) * BATCH * arrays[0].nbytes
    cases = {
        "bare copy": bare,
        "zero-copy (default)": through(oob),
        "pickle in band": through(inband),
    }
    for fn in cases.values():  # warm-up: page cache, allocator, fork-free imports
        fn()
    results: dict[str, list[float]] = {k: [] for k in cases}
    ratios: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        this = {k: rate(used, fn) for k, fn in cases.items()}
        for k, v in this.items():
            results[k].append(v)
            ratios[k].append(v / this["bare copy"])
    print(
        f"\n{records} records x {arrays[0].nbytes / 1024:.0f} KiB float32 arrays "
        f"({nbytes / 2**20:.0f} MiB), batch {BATCH}, {rounds} rounds"
    )
    print(f"{'':<22}{'MB/s':>10}{'spread':>16}{'x bare copy':>13}")
    for k in cases:
        lo, hi = min(results[k]), max(results[k])
        print(
            f"{k:<22}{statistics.median(results[k]):>10,.0f}{f'{lo:,.0f}-{hi:,.0f}':>16}"
            f"{statistics.median(ratios[k]):>13.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=1024, help="records of 256 KiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        if args.smoke:
            workload(64, 72, 1, root)
            return
        workload(args.records, 256, args.rounds, root)
        workload(args.records // 4, 1024, args.rounds, root)


if __name__ == "__main__":
    main()

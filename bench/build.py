"""P6: building a cache vs. serializing the same records alone; and the cost of opening it.

Prints one table: rates (records/s and MB/s), the ratio to the serialize-only baseline of
the same round, and the median and spread over the rounds. The records come from a list in
memory, and (``dataset`` rows) from a map-style dataset that makes each record from its
index, as one that reads files would: built with ``num_proc`` 1 and 2 against reading and
serializing it alone in one process.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import dataset_rt as drt


def make_records(n: int, record_kb: float, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    side = max(1, int((record_kb * 1024 / 3) ** 0.5))
    labels = rng.choice(10, size=n, p=[0.3, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03])
    return [
        {
            "image": rng.integers(0, 255, size=(3, side, side), dtype=np.uint8),
            "label": int(labels[i]),
            "caption": f"sample {i}",
        }
        for i in range(n)
    ]


class Generated:
    """A map-style dataset whose records are made from their index (standing for files
    read and decoded in ``__getitem__``): it pickles as a few numbers."""

    def __init__(self, n: int, record_kb: float) -> None:
        self.n, self.side = n, max(1, int((record_kb * 1024 / 3) ** 0.5))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng(index)
        image = rng.integers(0, 255, size=(3, self.side, self.side), dtype=np.uint8)
        return {"image": image, "label": index % 10, "caption": f"sample {index}"}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--record-kb", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    records = make_records(args.records, args.record_kb)
    nbytes = sum(len(pickle.dumps(r, protocol=5)) for r in records)
    print(
        f"workload: {args.records:,} records, {nbytes / args.records / 1024:.1f} KiB each "
        f"pickled, {nbytes / 2**20:.0f} MiB in all; {args.rounds} rounds after a warm-up"
    )

    rows: dict[str, list[float]] = {
        "serialize only": [],
        "drt.cache": [],
        "drt.cache+meta": [],
        "drt.open": [],
        "dataset: read + serialize": [],
        "dataset: num_proc=1": [],
        "dataset: num_proc=2": [],
    }
    dataset = Generated(args.records, args.record_kb)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for round_ in range(args.rounds + 1):  # round 0 warms up and is discarded

            def serialize() -> None:
                for r in records:
                    pickle.dumps(r, protocol=5)

            t_ser = timed(serialize)
            t_build = timed(
                lambda: drt.cache(records, "bench-build", root=root, overwrite=True, progress=False)
            )
            t_meta = timed(
                lambda: drt.cache(
                    records,
                    "bench-build",
                    root=root,
                    metadata=lambda r: {"label": r["label"], "caption": r["caption"]},
                    overwrite=True,
                    progress=False,
                )
            )
            t_open = timed(lambda: drt.open("bench-build", root=root).get(0))

            def read_and_serialize() -> None:
                for i in range(len(dataset)):
                    pickle.dumps(dataset[i], protocol=5)

            by_procs = [
                timed(
                    lambda k=k: drt.cache(
                        dataset,
                        "bench-dataset",
                        root=root,
                        metadata=lambda r: {"label": r["label"]},
                        num_proc=k,
                        overwrite=True,
                        progress=False,
                    )
                )
                for k in (1, 2)
            ]
            t_read = timed(read_and_serialize)
            if round_ > 0:
                rows["serialize only"].append(t_ser)
                rows["drt.cache"].append(t_build)
                rows["drt.cache+meta"].append(t_meta)
                rows["drt.open"].append(t_open)
                rows["dataset: read + serialize"].append(t_read)
                rows["dataset: num_proc=1"].append(by_procs[0])
                rows["dataset: num_proc=2"].append(by_procs[1])

    print(f"\n{'step':<27}{'median s':>10}{'spread s':>10}{'records/s':>12}{'MB/s':>9}{'ratio':>8}")
    for step, times in rows.items():
        base = statistics.median(
            rows["dataset: read + serialize" if step.startswith("dataset") else "serialize only"]
        )
        med = statistics.median(times)
        spread = max(times) - min(times)
        if step == "drt.open":
            print(f"{step + ' + get(0)':<27}{med:>10.4f}{spread:>10.4f}{'':>12}{'':>9}{'':>8}")
            continue
        ratio = base / med  # >1 means faster than serializing alone
        print(
            f"{step:<27}{med:>10.3f}{spread:>10.3f}{args.records / med:>12,.0f}"
            f"{nbytes / med / 1e6:>9.0f}{ratio:>8.2f}"
        )
    print(
        "\nratio = serialize-only time / step time (P6 target for drt.cache: >= 0.8)\n"
        "drt.cache writes and fsyncs every shard; +meta also calls a metadata() lambda per\n"
        "record and writes the Parquet table. dataset rows: ratio to reading and serializing\n"
        "the dataset in one process (num_proc=k target: >= 0.85 k on k free cores)."
    )


if __name__ == "__main__":
    main()

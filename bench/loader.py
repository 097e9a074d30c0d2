"""Loader benchmarks (docs/design.md P1, P2, P3, P5, P7) with same-run baselines.

P1  raw random weighted reads into Python, vs. a pure-Python mmap + numpy offsets reader
P2  end-to-end pickle decode in one process, vs. decoding the same bytes from a list in RAM
P7  throughput with num_workers = 0, 1, 2 (decode + PyTorch collate), for 3 KiB records and
    for 256 KiB arrays (the workers' return path)
P3  open + first batch in a fresh process, over .metadata and over .scan() (whose loader
    maps the plan saved with the version), at 1M (and with --scale 10M) samples
P5  PSS of the parent and each worker with num_workers = 0, 1, 2
    sampler build time for 100M rows (with --scale)

Every figure is the median of --rounds runs after a warm-up, with the spread. A figure and
its baseline run in alternation, round by round, and its ratio is the median of the ratios
within a round: on a noisy machine both sides of a ratio then see the same conditions.
Page cache: warm (every file is read once first).
"""

from __future__ import annotations

import argparse
import atexit
import mmap
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

import dataset_rt as drt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measuring import Paired, paired

ROOT = Path(tempfile.mkdtemp(prefix="drt-bench-loader-"))
# Its caches and flat files take about 700 MB: a run leaves none of it behind.
atexit.register(shutil.rmtree, ROOT, ignore_errors=True)


def records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    labels = rng.choice(10, size=n, p=[0.3, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03])
    return [
        {
            "image": rng.integers(0, 255, size=(3, 32, 32), dtype=np.uint8),
            "label": int(labels[i]),
            "caption": f"sample {i}",
        }
        for i in range(n)
    ]


def rate(n: int, fn: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        fn()
        return n / (time.perf_counter() - start)

    return run


def row(name: str, result: Paired, unit: str = "samples/s") -> None:
    print(
        f"  {name:<44}{result.median:>14,.0f} {unit:<10}±{result.spread:>12,.0f}"
        f"{result.ratio:>8.2f}x"
    )


def show(candidates: list[tuple[str, Callable[[], float]]], rounds: int) -> None:
    """Measures the candidates in alternation (the first is the baseline) and prints them."""
    for result in paired(candidates, rounds):
        row(result.label, result)


def small_workload(n: int, rounds: int, draws: int) -> None:
    print(f"\n== {n:,} records of ~3 KiB, {draws:,} weighted draws per run ==")
    recs = records(n)
    payloads = [pickle.dumps(r, protocol=5) for r in recs]
    cache = drt.cache(
        recs, "bench-small", root=ROOT, progress=False, metadata=lambda r: {"label": r["label"]}
    )
    frame = cache.metadata.with_columns(weight=pl.col("label").drt.balance())
    draws_idx = frame.drt.epoch(seed=0, num_samples=draws)["sample_id"].to_numpy()

    # Baseline B: one flat file of pickles, numpy offsets, mmap slicing.
    flat = ROOT / "flat.bin"
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in payloads])
    flat.write_bytes(b"".join(payloads))
    with open(flat, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def baseline_raw() -> None:
        o = offsets
        for i in draws_idx:
            mm[o[i] : o[i + 1]]

    raw_loader = frame.drt.loader(
        batch_size=256, seed=0, num_samples=draws, decode=bytes, collate=list
    )

    def drt_raw() -> None:
        for _ in raw_loader:
            pass

    print("P1 raw random weighted reads into Python (no decode)")
    show(
        [
            ("B: mmap + numpy offsets (bytes per record)", rate(draws, baseline_raw)),
            ("dataset_rt loader (bytes per record)", rate(draws, drt_raw)),
        ],
        rounds,
    )

    in_ram = payloads

    def baseline_decode() -> None:
        for i in draws_idx:
            pickle.loads(in_ram[i])

    decode_loader = frame.drt.loader(batch_size=256, seed=0, num_samples=draws, collate=list)

    def drt_decode() -> None:
        for _ in decode_loader:
            pass

    print("P2 end-to-end pickle decode, one process")
    show(
        [
            ("A: pickle.loads from a list of bytes in RAM", rate(draws, baseline_decode)),
            ("dataset_rt loader, collate=list", rate(draws, drt_decode)),
        ],
        rounds,
    )

    by_workers(frame, "P7 decode + PyTorch collate, by worker count", 256, draws * 4, rounds)


def by_workers(frame: pl.DataFrame, title: str, batch_size: int, draws: int, rounds: int) -> None:
    """The default collate's rate with 0, 1 and 2 workers: P7, and the workers' return path."""
    print(title)
    runs: list[tuple[str, Callable[[], float]]] = []
    startups: dict[int, list[float]] = {}
    for workers in (0, 1, 2):
        loader = frame.drt.loader(
            batch_size=batch_size, seed=0, num_samples=draws, num_workers=workers
        )
        firsts: list[float] = []

        def run(loader: Any = loader, firsts: list[float] = firsts) -> float:
            # Steady-state rate: from the first batch to the last (worker start-up apart).
            start = time.perf_counter()
            it = iter(loader)
            next(it)
            first = time.perf_counter()
            firsts.append(first - start)
            count = 0
            for batch in it:
                count += len(batch["label"])
            return count / (time.perf_counter() - first)

        runs.append((f"num_workers={workers}", run))
        startups[workers] = firsts
    for workers, result in enumerate(paired(runs, rounds)):
        first = statistics.median(startups[workers])
        row(f"{result.label} (first batch after {first:.2f} s)", result)
    cores = os.cpu_count()
    print(
        f"  (targets: k workers >= 0.8*k x one, until decode saturates the {cores} cores; "
        ">= 0.8x num_workers=0 without a transform)"
    )


def large_workload(n: int, rounds: int, draws: int) -> None:
    """Workers returning 256 KiB arrays: each batch crosses back to the main process."""
    print(f"\n== {n:,} records of a 256 KiB array, {draws:,} weighted draws per run ==")
    rng = np.random.default_rng(1)
    cache = drt.cache(
        (
            {"image": rng.integers(0, 255, size=(256, 1024), dtype=np.uint8), "label": i % 10}
            for i in range(n)
        ),
        "bench-large",
        root=ROOT,
        progress=False,
        metadata=lambda r: {"label": r["label"]},
    )
    frame = cache.metadata.with_columns(weight=pl.col("label").drt.balance())
    by_workers(frame, "P7 256 KiB arrays, default collate, no transform", 32, draws, rounds)


STARTUP = """
import time
t0 = time.perf_counter()
import dataset_rt as drt
t1 = time.perf_counter()
c = drt.open({name!r}, root={root!r})
loader = c.{frame}.drt.loader(batch_size=256, seed=0, collate=list)
next(iter(loader))
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""

MEMORY = """
import os
from pathlib import Path
import dataset_rt as drt

def memory(pid):
    fields = {{}}
    for line in Path(f"/proc/{{pid}}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    # Anonymous memory is what a process holds privately (heap); mapped cache files are
    # page cache that every process shares, even while only one of them maps a page.
    return fields["Pss"], fields["Anonymous"]

def descendants(root):
    parents = {{}}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                stat = Path(f"/proc/{{p}}/stat").read_text()
                parents[int(p)] = int(stat.rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found

c = drt.open({name!r}, root={root!r})
loader = c.metadata.drt.loader(batch_size=256, seed=0, num_workers={workers},
                               num_samples=min(100_000, 10 * len(c)))
peak = {{}}
for i, _ in enumerate(loader):
    if i % 40 == 0:
        for pid in [os.getpid()] + descendants(os.getpid()):
            try:
                pss, private = memory(pid)
            except (OSError, KeyError):
                continue
            old = peak.get(pid, (0, 0))
            peak[pid] = (max(old[0], pss), max(old[1], private))
me = peak.pop(os.getpid())
# The DataLoader workers are the busy descendants; the fork server and the resource
# tracker idle beside them.
workers = sorted(peak.values(), reverse=True)[:{workers}]
print(me[0], me[1], ";".join(f"{{p}},{{q}}" for p, q in workers))
"""


def scale_points(sizes: list[int], rounds: int) -> None:
    private: dict[tuple[int, int], list[int]] = {}
    for n in sizes:
        name = f"bench-tiny-{n}"
        start = time.perf_counter()
        drt.cache(range(n), name, root=ROOT, progress=False, metadata=lambda i: {"label": i % 10})
        print(f"\n== {n:,} tiny records (built in {time.perf_counter() - start:.1f} s) ==")
        opens: dict[str, list[float]] = {"metadata": [], "scan()": []}
        imports = []
        for frame in opens:
            for _ in range(rounds + 1):
                code = STARTUP.format(name=name, root=str(ROOT), frame=frame)
                out = subprocess.run(
                    [sys.executable, "-c", code],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=ROOT,  # python -c puts its working directory first on sys.path
                )
                a, b = (float(x) for x in out.stdout.split())
                imports.append(a)
                opens[frame].append(b)
            opens[frame] = opens[frame][1:]
        print(f"P3 fresh process: import dataset_rt {statistics.median(imports) * 1000:.0f} ms")
        for frame, times in opens.items():
            print(
                f"  open + {frame} + loader + first batch {statistics.median(times) * 1000:.0f} "
                f"ms ± {(max(times) - min(times)) * 1000:.0f}"
            )
        print("P5 peak memory while iterating (KiB): PSS / anonymous, parent and each worker")
        for workers in (0, 1, 2):
            code = MEMORY.format(name=name, root=str(ROOT), workers=workers)
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
            )
            pss, priv, kids = [*out.stdout.strip().split(" "), ""][:3]
            kid_list = [tuple(int(v) for v in k.split(",")) for k in kids.split(";") if k]
            private[(n, workers)] = [int(priv)] + [k[1] for k in kid_list]
            shown = ", ".join(f"{p:,} / {q:,}" for p, q in kid_list) or "-"
            print(f"  num_workers={workers}: parent {int(pss):,} / {int(priv):,}; workers {shown}")
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        print(f"anonymous memory growth per sample from {small:,} to {large:,} samples:")
        for workers in (0, 1, 2):
            grow = [
                (b - a) * 1024 / (large - small)
                for a, b in zip(private[(small, workers)], private[(large, workers)], strict=False)
            ]
            print(
                f"  num_workers={workers}: "
                + ", ".join(f"{g:.1f}" for g in grow)
                + " bytes/sample (parent, workers)"
            )


def sampler_build(rows: int) -> None:
    weights = pl.DataFrame({"weight": np.random.default_rng(0).random(rows)})
    start = time.perf_counter()
    weights.select(pl.col("weight").drt.draws(1, seed=0))
    took = time.perf_counter() - start
    print(
        f"\nsampler for {rows:,} rows (alias table + one draw): {took:.2f} s, "
        f"8 bytes/row in the table"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--draws", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", action="store_true", help="add the 10M and 100M points")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check it runs")
    args = parser.parse_args()
    print(
        textwrap.dedent(f"""\
        machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, polars {pl.__version__}
        median of {args.rounds} rounds after a warm-up; ratio = figure / baseline""")
    )
    small_workload(args.records, args.rounds, args.draws)
    large_workload(200 if args.smoke else 1_000, args.rounds, 640 if args.smoke else 8_000)
    if args.smoke:
        sizes, sampler_rows = [2_000, 20_000], 100_000
    elif args.scale:
        sizes, sampler_rows = [1_000_000, 10_000_000], 100_000_000
    else:
        sizes, sampler_rows = [1_000_000], 10_000_000
    scale_points(sizes, args.rounds)
    sampler_build(sampler_rows)


if __name__ == "__main__":
    main()

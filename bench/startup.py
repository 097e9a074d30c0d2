"""Start-up (docs/design.md P3): a fresh interpreter's first batch, side by side with the
NumPy mmap-offsets reader, and a fresh process's first batch from 1M to 100M samples.

First, side by side: 50,000 small records (a 3x32x32 uint8 image and a label), written once
as a cache and once as the baseline's flat file of pickles with a NumPy offsets array; each
child interpreter is timed from its launch to its first batch of 256 random draws. The
dataset_rt children also report how long ``import polars`` and the rest of ``import
dataset_rt`` took. The target is the baseline + 0.1 s.

Then, for each size, builds a cache of that many 8-byte records once, then times in fresh
processes (warm page cache) ``import dataset_rt`` and open + loader + first batch, with the
loader made from ``cache.metadata`` (the table is read and a plan built) and from
``cache.scan()`` (the plan saved with the version is mapped), and prints the process's RSS,
PSS and anonymous memory after the first batch. Medians of --rounds runs after a warm-up.

    python bench/startup.py                      # 1M and 10M
    python bench/startup.py --sizes 1e6,1e7,1e8  # 100M: ~45 s to build, ~8 GB of disk
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import dataset_rt as drt

CHILD = """
import time
t0 = time.perf_counter()
import dataset_rt as drt
t1 = time.perf_counter()
cache = drt.open({name!r}, root={root!r})
loader = cache.{frame}.drt.loader(batch_size=256, seed=0, decode=bytes, collate=list)
next(iter(loader))
t2 = time.perf_counter()
memory = {{}}
for line in open("/proc/self/smaps_rollup").read().splitlines()[1:]:
    key, value = line.split(":", 1)
    memory[key] = int(value.split()[0])
print(t1 - t0, t2 - t1, memory["Rss"], memory["Pss"], memory["Anonymous"])
"""


FIRST_BATCH = """
import time
t0 = time.time()
import polars
t1 = time.time()
import dataset_rt as drt
t2 = time.time()
cache = drt.open("side-by-side", root={root!r})
next(iter(cache.{frame}.drt.loader(batch_size=256, seed=0, collate=list)))
print(time.time(), t1 - t0, t2 - t1)
"""

BASELINE = """
import mmap, pickle, time
import numpy as np
with open({flat!r}, "rb") as f:
    records = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
offsets = np.load({offsets!r})
draws = np.random.default_rng(0).integers(0, len(offsets) - 1, 256)
batch = [pickle.loads(records[offsets[i] : offsets[i + 1]]) for i in draws.tolist()]
print(time.time(), 0, 0)
"""


def identity(record: bytes) -> bytes:
    return record


def small_record(i: int) -> dict[str, object]:
    return {"image": np.full((3, 32, 32), i % 256, dtype=np.uint8), "label": i % 10}


def side_by_side(root: str, n: int, rounds: int) -> None:
    """Fresh interpreter to first batch: dataset_rt against the mmap-offsets baseline."""
    drt.cache((small_record(i) for i in range(n)), "side-by-side", root=root, progress=False)
    flat, offsets = f"{root}/baseline.bin", f"{root}/offsets.npy"
    ends = [0]
    with open(flat, "wb") as out:
        for i in range(n):
            ends.append(ends[-1] + out.write(pickle.dumps(small_record(i), protocol=5)))
    np.save(offsets, np.array(ends, dtype=np.int64))

    def launch(code: str) -> list[float]:
        start = time.time()
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
        )
        first, *imports = (float(x) for x in done.stdout.split())
        return [first - start, *imports]

    children = {
        "baseline (mmap offsets)": BASELINE.format(flat=flat, offsets=offsets),
        "dataset_rt, cache.scan()": FIRST_BATCH.format(root=root, frame="scan()"),
        "dataset_rt, cache.metadata": FIRST_BATCH.format(root=root, frame="metadata"),
    }
    # Interleaved rounds, so that a slow moment of the machine hits every child alike.
    times: dict[str, list[list[float]]] = {name: [] for name in children}
    for _ in range(rounds + 1):
        for name, code in children.items():
            times[name].append(launch(code))
    print(f"== fresh interpreter to its first batch, {n:,} small records, side by side ==")
    base = statistics.median(r[0] for r in times["baseline (mmap offsets)"][1:])
    for name, runs in times.items():
        first, polars, own = (statistics.median(r[i] for r in runs[1:]) for i in range(3))
        line = f"  {name:<27} {first * 1000:5.0f} ms"
        if polars:
            line += (
                f" (+{(first - base) * 1000:.0f} ms; import polars {polars * 1000:.0f} ms, "
                f"the rest of import dataset_rt {own * 1000:.0f} ms)"
            )
        print(line)
    print("  target: the baseline + 100 ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7", help="comma-separated sample counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check it runs")
    args = parser.parse_args()
    sizes = [2_000] if args.smoke else [int(float(s)) for s in args.sizes.split(",")]
    rounds = 1 if args.smoke else args.rounds
    print(f"machine: Python {sys.version.split()[0]}, dataset_rt {drt.__version__}")
    with tempfile.TemporaryDirectory(prefix="drt-bench-startup-") as root:
        side_by_side(root, 2_000 if args.smoke else 50_000, max(rounds, 1 if args.smoke else 5))
        for n in sizes:
            start = time.perf_counter()
            drt.cache(
                (i.to_bytes(8, "little") for i in range(n)),
                f"startup-{n}",
                root=root,
                serializer=identity,
                progress=False,
            )
            print(f"== {n:,} samples (built in {time.perf_counter() - start:.1f} s) ==")
            for frame in ("metadata", "scan()"):
                code = CHILD.format(name=f"startup-{n}", root=root, frame=frame)
                runs = [
                    [
                        float(x)
                        for x in subprocess.run(
                            [sys.executable, "-c", code],
                            capture_output=True,
                            text=True,
                            check=True,
                            cwd=root,  # python -c puts its working directory on sys.path
                        ).stdout.split()
                    ]
                    for _ in range(rounds + 1)
                ][1:]
                imports = statistics.median(r[0] for r in runs)
                opens = [r[1] for r in runs]
                rss, pss, anon = (int(statistics.median(r[i] for r in runs)) for i in (2, 3, 4))
                first, spread = statistics.median(opens) * 1000, (max(opens) - min(opens)) * 1000
                print(
                    f"  {frame:<9} import {imports * 1000:5.0f} ms; open + loader + first batch "
                    f"{first:7.1f} ms ± {spread:.1f}; RSS / PSS / anonymous {rss / 1024:,.0f} / "
                    f"{pss / 1024:,.0f} / {anon / 1024:,.0f} MiB"
                )


if __name__ == "__main__":
    main()

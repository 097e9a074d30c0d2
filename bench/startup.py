"""Start-up at scale (docs/design.md P3): a fresh process's first batch, 1M to 100M samples.

For each size, builds a cache of that many 8-byte records once, then times in fresh
processes (warm page cache) ``import dataset_rt`` and open + loader + first batch, with the
loader made from ``cache.metadata`` (the table is read and a plan built) and from
``cache.scan()`` (the plan saved with the version is mapped), and prints the process's RSS,
PSS and anonymous memory after the first batch. Medians of --rounds runs after a warm-up.

    python bench/startup.py                      # 1M and 10M
    python bench/startup.py --sizes 1e6,1e7,1e8  # 100M: ~45 s to build, ~8 GB of disk
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

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


def identity(record: bytes) -> bytes:
    return record


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
                            [sys.executable, "-c", code], capture_output=True, text=True, check=True
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

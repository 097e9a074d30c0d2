"""Start-up and memory of the packed loader from 1M to 100M documents (token-stream issue).

For each size, a token cache of that many short documents (1 to 4 uint16 ids each: as small
as documents get, so that every figure shows what grows with the document count and
nothing else) is built once, and the baseline's flat token file of the same ids beside it.
Then fresh processes (warm page cache) each time their imports (PyTorch's too: a training
process has it loaded before its loader starts), then open + first batch of ``[8, 2048]``
tokens and their targets as tensors, and report their memory after 50 more batches:

- baseline: the flat file as a NumPy ``memmap``, read at random ``seq_len + 1`` windows into
  a preallocated int64 batch (nanoGPT-style: no weights, no documents);
- ``cache.scan()``: a packed loader over the saved version, which maps the plan saved with
  it (each document's length and their sum are in it): nothing of the table is read;
- ``cache.metadata``: a packed loader over the table in memory, which writes a plan of its
  own (O(documents), for comparison; up to 10M documents).

Targets: the scan's open + first batch ≤ the baseline's + 0.1 s at 100M documents, and the
reading process's own (anonymous) memory flat in the document count. Medians of --rounds
runs after a warm-up.

    python bench/tokens_scale.py                      # 1M and 10M documents
    python bench/tokens_scale.py --sizes 1e6,1e7,1e8  # 100M: minutes to build, ~9 GB of disk
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import dataset_rt as drt

VOCAB = 50_257
ROWS, SEQ_LEN, MORE = 8, 2048, 50

MEMORY = """
memory = {{}}
for line in open("/proc/self/smaps_rollup").read().splitlines()[1:]:
    key, value = line.split(":", 1)
    memory[key] = int(value.split()[0])
print(t1 - t0, t2 - t1, memory["Rss"], memory["Anonymous"])
"""

PACKED = (
    """
import time
t0 = time.perf_counter()
import dataset_rt as drt
import torch
t1 = time.perf_counter()
cache = drt.open({name!r}, root={root!r})
batches = iter(cache.{frame}.drt.loader({rows}, seq_len={seq_len}, seed=0))
next(batches)
t2 = time.perf_counter()
for _ in range({more}):
    next(batches)
"""
    + MEMORY
)

BASELINE = (
    """
import time
t0 = time.perf_counter()
import numpy as np
import torch
t1 = time.perf_counter()
data = np.memmap({flat!r}, dtype=np.uint16, mode="r")
rng = np.random.default_rng(0)

def batch():
    out = np.empty(({rows}, {seq_len} + 1), dtype=np.int64)
    for i, s in enumerate(rng.integers(0, len(data) - {seq_len} - 1, size={rows})):
        out[i] = data[s : s + {seq_len} + 1]
    x = torch.from_numpy(out)
    return x[:, :-1], x[:, 1:]

batch()
t2 = time.perf_counter()
for _ in range({more}):
    batch()
"""
    + MEMORY
)


def lengths_of(first: int, last: int) -> np.ndarray:
    """The lengths (1 to 4) of documents ``first`` to ``last - 1``."""
    index = np.arange(first, last, dtype=np.uint64)
    return (1 + ((index * np.uint64(2654435761)) >> np.uint64(7)) % np.uint64(4)).astype(np.int64)


class Documents:
    """Documents ``0`` to ``n - 1``, map-style, so that ``num_proc=2`` builds them in parallel.

    Document ``i`` is the ids ``i % VOCAB``, ``i % VOCAB + 1``, ... of its length.
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        start = i % VOCAB  # the length as lengths_of computes it, in Python ints
        return np.arange(start, start + 1 + ((i * 2654435761) >> 7) % 4, dtype=np.uint16)


def write_flat(n: int, path: Path) -> None:
    """The baseline's file: every document's ids, one after another, as uint16."""
    step = 1 << 22
    with path.open("wb") as out:
        for first in range(0, n, step):
            last = min(n, first + step)
            lengths = lengths_of(first, last)
            starts = np.arange(first, last, dtype=np.int64) % VOCAB
            ends = np.cumsum(lengths)
            within = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - lengths, lengths)
            out.write((np.repeat(starts, lengths) + within).astype(np.uint16).tobytes())


def launch(code: str, root: str) -> list[float]:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,  # python -c puts its working directory on sys.path
    )
    return [float(x) for x in done.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7", help="comma-separated document counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-proc", type=int, default=2, help="processes building each cache")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check it runs")
    args = parser.parse_args()
    sizes = [20_000] if args.smoke else [int(float(s)) for s in args.sizes.split(",")]
    rounds = 1 if args.smoke else args.rounds
    shape: dict[str, Any] = {"rows": ROWS, "seq_len": SEQ_LEN, "more": 2 if args.smoke else MORE}
    print(f"machine: Python {sys.version.split()[0]}, dataset_rt {drt.__version__}")
    print(f"batches of {ROWS} x {SEQ_LEN} tokens (+1 target); memory after {shape['more']} more")
    with tempfile.TemporaryDirectory(prefix="drt-bench-tokens-scale-") as root:
        for n in sizes:
            name = f"tokens-{n}"
            start = time.perf_counter()
            drt.cache(
                Documents(n),
                name,
                root=root,
                serializer="tokens:uint16",
                num_proc=args.num_proc,
                progress=False,
            )
            built = time.perf_counter() - start
            flat = Path(root) / f"flat-{n}.u16"
            write_flat(n, flat)
            tokens = flat.stat().st_size // 2
            print(f"== {n:,} documents, {tokens:,} tokens (cached in {built:.0f} s) ==")
            children = {
                "baseline (memmap)": BASELINE.format(flat=str(flat), **shape),
                "cache.scan()": PACKED.format(name=name, root=root, frame="scan()", **shape),
            }
            if n <= 10_000_000:  # it reads the whole table: seconds from 10M on
                children["cache.metadata"] = PACKED.format(
                    name=name, root=root, frame="metadata", **shape
                )
            # Interleaved rounds, so that a slow moment of the machine hits every child alike.
            runs: dict[str, list[list[float]]] = {label: [] for label in children}
            for _ in range(rounds + 1):
                for label, code in children.items():
                    runs[label].append(launch(code, root))
            base = statistics.median(r[1] for r in runs["baseline (memmap)"][1:])
            for label, measured in runs.items():
                kept = measured[1:]
                imports = statistics.median(r[0] for r in kept)
                opens = [r[1] for r in kept]
                first, spread = statistics.median(opens), max(opens) - min(opens)
                rss, anon = (statistics.median(r[i] for r in kept) / 1024 for i in (2, 3))
                print(
                    f"  {label:<18} import {imports * 1000:5.0f} ms; open + first batch "
                    f"{first * 1000:8.1f} ms ± {spread * 1000:.1f} ({(first - base) * 1000:+.1f} "
                    f"ms vs the baseline); RSS {rss:,.0f} MiB, anonymous {anon:,.0f} MiB"
                )
            # One size's files at a time on disk.
            shutil.rmtree(Path(root) / name)
            flat.unlink()
    print(
        "targets: cache.scan() open + first batch ≤ the baseline's + 100 ms at 100M; "
        "anonymous memory flat in the document count"
    )


if __name__ == "__main__":
    main()

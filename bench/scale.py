"""The scale workload of bench/run.py: dataset_rt and the mmap baseline at 1M, 10M and 100M rows.

    python bench/run.py --scale                       # 1M, 10M and 100M tiny records
    python bench/run.py --scale --sizes 1e6,1e7       # fewer sizes
    python bench/scale.py --sizes 1e6 --rounds 3      # the same, run directly

Each record is an 8-byte ``bytes`` object, pickled, with a skewed label in 10 classes: the
records are as small as they get, so that every figure shows what grows with the row count
and nothing else. The two systems hold the same pickles:

- ``dataset_rt``: ``drt.cache`` of the records (default serializer), then one metadata edit,
  saved once: the label column added and the classes balanced (``save_metadata``). That saved
  version is what training opens: ``cache.scan().drt.loader(...)``.
- ``mmap``: one flat file of the same pickles, a NumPy offsets array and a labels array
  beside it, both opened with ``mmap_mode="r"`` (loading 0.8 GB of offsets at 100M rows would
  not be a fair baseline), read by slicing an ``mmap``. It is handed its weighted draws,
  computed in advance by the runner: a lower bound for any reader that draws its own.

Figures per size, each for both systems, in fresh processes (warm page cache):

    start-up        fresh interpreter to the first batch of 256 weighted draws; "import" is
                    the system's imports alone, "open + first batch" the rest
    pass            one pass of 50,000 weighted draws in one process, samples/s; for
                    dataset_rt it includes making the loader
    2 workers       the same pass through 2 worker processes (dataset_rt: its loader; the
                    baseline: a PyTorch DataLoader over a map-style Dataset)
    memory          peak RSS / PSS / anonymous memory of the reading process, and of each of
                    the 2 workers; anonymous memory is what a process holds of its own
    filter          keep two classes, balance them, make a new loader and get its first
                    batch, with the metadata table already in memory (the baseline: its
                    labels array and NumPy)

Medians of --rounds runs after an untimed warm-up, with the spread (max - min).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # start-up probes count from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from measuring import MemorySampler, median_spread, runs  # noqa: E402

BATCH = 256
DRAWS = 50_000
CLASSES = (1, 2)
SKEW = (0.3, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03)
SIZES = "1e6,1e7,1e8"
SYSTEMS = ("dataset_rt", "mmap")


def record(i: int) -> bytes:
    return i.to_bytes(8, "little")


def labels_of(n: int) -> Any:
    import numpy as np

    return np.random.default_rng(0).choice(10, size=n, p=SKEW).astype(np.int64)


def balanced_draws(labels: Any, count: int, seed: int, classes: tuple[int, ...] = ()) -> Any:
    """``count`` indices drawn with replacement, each class (of ``classes``) equally likely.

    Drawing a class, then a row within it, is the same distribution as weights of
    ``1 / class size``, at a cost the baseline can afford at 100M rows.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=10)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    keep = np.array(classes or [c for c in range(10) if counts[c]])
    chosen = keep[rng.integers(0, len(keep), size=count)]
    within = (rng.random(count) * counts[chosen]).astype(np.int64)
    return order[starts[chosen] + within]


# -- the two systems ------------------------------------------------------------------------
class DatasetRT:
    name = "dataset_rt"

    @staticmethod
    def build(n: int, path: Path) -> dict[str, float]:
        import polars as pl

        import dataset_rt as drt

        start = time.perf_counter()
        cache = drt.cache((record(i) for i in range(n)), "scale", root=path, progress=False)
        built = time.perf_counter() - start
        labels = pl.Series("label", labels_of(n))
        start = time.perf_counter()
        cache.save_metadata(
            cache.metadata.with_columns(labels).with_columns(weight=pl.col("label").drt.balance())
        )
        return {"seconds": built, "save_metadata": time.perf_counter() - start}

    @staticmethod
    def open(path: Path) -> Any:
        import dataset_rt as drt

        return drt.open("scale", root=path)

    @staticmethod
    def loader(cache: Any, draws: Any, workers: int = 0) -> Any:
        return cache.scan().drt.loader(
            batch_size=BATCH,
            seed=1,
            num_samples=len(draws),
            collate=list,
            num_workers=workers,
        )

    @staticmethod
    def refilter(cache: Any) -> Any:
        import polars as pl

        frame = cache.metadata.filter(pl.col("label").is_in(list(CLASSES))).with_columns(
            weight=pl.col("label").drt.balance()
        )
        loader = frame.drt.loader(batch_size=BATCH, seed=2, num_samples=DRAWS, collate=list)
        return next(iter(loader))

    @staticmethod
    def warm(cache: Any) -> None:
        cache.metadata  # noqa: B018  (the user's frame, in memory before they edit it)


class Mmap:
    name = "mmap"

    @staticmethod
    def build(n: int, path: Path) -> dict[str, float]:
        import numpy as np

        start = time.perf_counter()
        path.mkdir(parents=True, exist_ok=True)
        # Every record pickles to the same length: the file is one template, tiled, with
        # each record's 8 bytes written in place.
        template = np.frombuffer(pickle.dumps(record(0), protocol=5), dtype=np.uint8)
        at = template.tobytes().index(record(0))
        step = 1 << 22
        with open(path / "records.bin", "wb") as f:
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                block = np.tile(template, (hi - lo, 1))
                block[:, at : at + 8] = (
                    np.arange(lo, hi, dtype="<u8")[:, None].view(np.uint8).reshape(-1, 8)
                )
                f.write(block.tobytes())
        np.save(path / "offsets.npy", np.arange(n + 1, dtype=np.int64) * len(template))
        np.save(path / "labels.npy", labels_of(n))
        return {"seconds": time.perf_counter() - start}

    @staticmethod
    def open(path: Path) -> Any:
        import mmap

        import numpy as np

        with open(path / "records.bin", "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        offsets = np.load(path / "offsets.npy", mmap_mode="r")
        return mm, offsets, np.load(path / "labels.npy", mmap_mode="r"), path

    @staticmethod
    def get_many(handle: Any, indices: Any) -> list[Any]:
        mm, offsets = handle[0], handle[1]
        starts, ends = offsets[indices].tolist(), offsets[indices + 1].tolist()
        return [pickle.loads(mm[s:e]) for s, e in zip(starts, ends, strict=True)]

    @staticmethod
    def loader(handle: Any, draws: Any, workers: int = 0) -> Any:
        if not workers:
            return (
                Mmap.get_many(handle, draws[lo : lo + BATCH]) for lo in range(0, len(draws), BATCH)
            )
        from torch.utils.data import DataLoader

        return DataLoader(
            _MmapDataset(handle[3]),
            batch_size=BATCH,
            sampler=draws.tolist(),
            num_workers=workers,
            collate_fn=list,
        )

    @staticmethod
    def refilter(handle: Any) -> Any:
        draws = balanced_draws(handle[2], DRAWS, seed=2, classes=CLASSES)
        return next(iter(Mmap.loader(handle, draws)))

    @staticmethod
    def warm(handle: Any) -> None:
        pass


class _MmapDataset:
    """A map-style Dataset over the baseline; each worker process maps the files itself."""

    def __init__(self, path: Path) -> None:
        self.path, self.handle = path, None

    def __getitems__(self, indices: list[int]) -> list[Any]:
        import numpy as np

        if self.handle is None:
            self.handle = Mmap.open(self.path)
        return Mmap.get_many(self.handle, np.asarray(indices))

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "handle": None}


IMPLEMENTATIONS: dict[str, Any] = {"dataset_rt": DatasetRT, "mmap": Mmap}


# -- probes, each in a fresh process --------------------------------------------------------
def probe_startup(system: Any, path: Path) -> dict[str, Any]:
    if system is DatasetRT:
        import dataset_rt  # noqa: F401
    else:
        import numpy  # noqa: F401
    imported = time.perf_counter()
    if system is DatasetRT:
        draws: Any = range(BATCH)  # it draws its own: only the count is used
    else:
        import numpy as np

        draws = np.load(path.parent / "draws.npy")[:BATCH]
    handle = system.open(path)
    batch = next(iter(system.loader(handle, draws)))
    assert len(batch) == BATCH
    done = time.perf_counter()
    return {"import": imported - _T0, "open": done - imported, "total": done - _T0}


def probe_measure(system: Any, path: Path, rounds: int) -> dict[str, Any]:
    import numpy as np

    draws = np.load(path.parent / "draws.npy")
    handle = system.open(path)
    memory = MemorySampler()
    memory.start()
    out: dict[str, Any] = {}

    # Each pass is timed before the memory is sampled: reading /proc/<pid>/smaps_rollup walks
    # the page tables of every mapping, 40-80 ms at 100M rows, as long as a pass itself.
    def one_process() -> float:
        start = time.perf_counter()
        n = sum(len(batch) for batch in system.loader(handle, draws))
        elapsed = time.perf_counter() - start
        memory.sample()
        assert n == len(draws), n
        return n / elapsed

    memory.take()
    out["read"] = runs(one_process, rounds)
    out["memory_read"] = memory.take()

    def two_workers() -> float:
        batches = iter(system.loader(handle, draws, workers=2))
        next(batches)  # worker start-up is not throughput
        memory.sample()
        start, n = time.perf_counter(), 0
        for batch in batches:
            n += len(batch)
        elapsed = time.perf_counter() - start
        memory.sample()
        return n / elapsed

    out["workers"] = runs(two_workers, rounds)
    out["memory_workers"] = memory.take()
    memory.stop()

    system.warm(handle)

    def refilter() -> float:
        start = time.perf_counter()
        assert len(system.refilter(handle)) == BATCH
        return time.perf_counter() - start

    out["filter"] = runs(refilter, rounds)
    return out


def probe_main(args: argparse.Namespace) -> None:
    system, path = IMPLEMENTATIONS[args.system], Path(args.dir)
    if args.probe == "build":
        out = system.build(args.n, path)
    elif args.probe == "startup":
        out = probe_startup(system, path)
    else:
        out = probe_measure(system, path, args.rounds)
    print("\n" + json.dumps({"probe": out}))


# -- orchestrating --------------------------------------------------------------------------
def child(args: argparse.Namespace, probe: str, system: str, n: int, path: Path) -> Any:
    cmd = [sys.executable, __file__, "--probe", probe, "--system", system, "--n", str(n)]
    cmd += ["--dir", str(path), "--rounds", str(args.rounds)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith('{"probe"'):
            return json.loads(line)["probe"]
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
    failed = f"{probe} of {system} at {n:,} rows failed (exit {done.returncode})"
    raise RuntimeError(f"{failed}:\n{tail}")


def disk_bytes(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def run_size(args: argparse.Namespace, n: int, root: Path) -> dict[str, Any]:
    import numpy as np

    where = root / f"{n}"
    where.mkdir(parents=True, exist_ok=True)
    np.save(where / "draws.npy", balanced_draws(labels_of(n), DRAWS, seed=1))
    results: dict[str, Any] = {}
    for system in SYSTEMS:
        path = where / system
        r = results[system] = {"build": child(args, "build", system, n, path)}
        r["build"]["bytes"] = disk_bytes(path)
        # What locates the records: dataset_rt's index, the baseline's offsets array.
        index = path / "scale" / "index.arrow" if system == "dataset_rt" else path / "offsets.npy"
        r["build"]["index_bytes"] = index.stat().st_size
        r.update(child(args, "measure", system, n, path))
        starts = [child(args, "startup", system, n, path) for _ in range(args.rounds + 1)][1:]
        for key in ("import", "open", "total"):
            r[f"startup_{key}"] = median_spread([s[key] for s in starts])
        shutil.rmtree(path, ignore_errors=True)
        print(f"  measured {system} at {n:,} rows", flush=True)
    table(n, results)
    return results


def _cell(value: dict[str, float], scale: float, digits: int, base: float | None) -> str:
    text = f"{value['median'] * scale:,.{digits}f} ±{value['spread'] * scale:,.{digits}f}"
    return text + (f" ({value['median'] / base:.2f}x)" if base else "")


def table(n: int, results: dict[str, Any]) -> None:
    base = results["mmap"]

    def mib(b: float) -> str:
        return f"{b / 2**20:,.0f}"

    print(
        f"\n{n:,} rows\n\n| system | build s | disk GB | start-up s | import s "
        "| open + first batch ms | pass, samples/s | 2 workers, samples/s "
        "| reader: RSS / PSS / anon MiB | anon beyond mmap, B/row | each worker: PSS / anon MiB "
        "| filter + re-weight + first batch s | index B/row |"
    )
    print("| --- |" + " ---: |" * 12)
    for name, r in results.items():
        ref = (lambda key: base[key]["median"]) if name != "mmap" else (lambda key: None)
        parent = r["memory_read"]["parent"]
        workers = r["memory_workers"]["workers"]
        cells = [
            name,
            f"{r['build']['seconds']:,.1f}"
            + (f" + {r['build']['save_metadata']:.1f}" if "save_metadata" in r["build"] else ""),
            f"{r['build']['bytes'] / 1e9:,.2f}",
            _cell(r["startup_total"], 1, 3, ref("startup_total")),
            _cell(r["startup_import"], 1, 3, None),
            _cell(r["startup_open"], 1000, 1, ref("startup_open")),
            _cell(r["read"], 1, 0, ref("read")),
            _cell(r["workers"], 1, 0, ref("workers")),
            " / ".join(mib(m) for m in parent),
            f"{(parent[2] - base['memory_read']['parent'][2]) / n:,.1f}",
            ", ".join(f"{mib(w[1])} / {mib(w[2])}" for w in workers) or "-",
            _cell(r["filter"], 1, 3, ref("filter")),
            f"{r['build']['index_bytes'] / n:.1f}",
        ]
        print("| " + " | ".join(cells) + " |")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every size in ``args.sizes``; returns the figures by size and system."""
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    owned = args.root is None
    root = Path(args.root or tempfile.mkdtemp(prefix="drt-bench-scale-")) / "scale"
    print(
        f"\n== scale: tiny records (8 bytes, pickled), {DRAWS:,} weighted draws per pass, "
        f"sizes {', '.join(f'{n:,}' for n in sizes)} ==",
        flush=True,
    )
    report = {}
    try:
        for n in sizes:
            report[str(n)] = run_size(args, n, root)
    finally:
        if owned:
            shutil.rmtree(root.parent, ignore_errors=True)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=SIZES, help="comma-separated row counts (scale)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", help="where to build (default: a new temporary directory)")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    parser.add_argument("--probe", choices=["build", "measure", "startup"], help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe_main(args)
        return
    print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

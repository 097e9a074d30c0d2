"""P6: building a cache vs. serializing the same records alone; and the cost of opening it.

Prints one table: rates (records/s and MB/s), the ratio to the serialize-only baseline of
the same round, and the median and spread over the rounds. The records come from a list in
memory, and (``dataset`` rows) from a map-style dataset that makes each record from its
index, as one that reads files would: built with ``num_proc`` 1 and 2, and with ``--ray``
through ``dataset_rt.ray.cache`` on a local Ray cluster of 2 CPUs, against reading and
serializing it alone in one process.

A second table (``--compression``) builds the list with zstd and lz4 against no
compression, on the image records (random bytes: the worst case) and on token records
(integer arrays, as text datasets hold), and reads each cache back in one shuffled loader
pass: ratio on disk, build rate, read rate.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
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


def make_tokens(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Text-like records: 512 token ids below 32,000 as int64 (about 4 KiB pickled)."""
    rng = np.random.default_rng(seed)
    return [
        {"tokens": rng.zipf(1.3, size=512).clip(0, 31_999).astype(np.int64), "label": i % 10}
        for i in range(n)
    ]


def ray_dataset(n: int, record_kb: float) -> Any:
    """``Generated`` as a Ray dataset: rows made from their index in Ray's tasks."""
    import ray.data

    side = max(1, int((record_kb * 1024 / 3) ** 0.5))

    def row(r: dict[str, Any]) -> dict[str, Any]:
        index = int(r["id"])
        rng = np.random.default_rng(index)
        image = rng.integers(0, 255, size=(3, side, side), dtype=np.uint8)
        return {"image": image, "label": index % 10, "caption": f"sample {index}"}

    return ray.data.range(n, override_num_blocks=max(2, n // 20_000)).map(row)


def write_synced(path: Path, blob: bytes) -> None:
    """Writes ``blob`` to ``path`` 4 MiB at a time and syncs it, as a build writes a shard."""
    with open(path, "wb", buffering=0) as f:
        view = memoryview(blob)
        for start in range(0, len(view), 4 << 20):
            f.write(view[start : start + (4 << 20)])
        os.fsync(f.fileno())
    path.unlink()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--record-kb", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--datasets-only", action="store_true", help="skip the rows that build from a list"
    )
    parser.add_argument("--ray", action="store_true", help="also build through Ray Data")
    parser.add_argument(
        "--compression", action="store_true", help="also compare zstd and lz4 with none"
    )
    args = parser.parse_args()
    if args.datasets_only:
        build_from_datasets(args)
        return

    records = make_records(args.records, args.record_kb)
    nbytes = sum(len(pickle.dumps(r, protocol=5)) for r in records)
    print(
        f"workload: {args.records:,} records, {nbytes / args.records / 1024:.1f} KiB each "
        f"pickled, {nbytes / 2**20:.0f} MiB in all; {args.rounds} rounds after a warm-up"
    )

    rows: dict[str, list[float]] = {
        "serialize only": [],
        "write + fsync, same bytes": [],
        "drt.cache": [],
        "drt.cache, root in RAM": [],
        "drt.cache+meta": [],
        "drt.open": [],
    }
    in_ram = Path("/dev/shm")  # tmpfs on Linux: the build without the disk's write path
    with (
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(dir=in_ram if in_ram.is_dir() else None) as ram,
    ):
        root = Path(tmp)
        blob = os.urandom(nbytes)
        for round_ in range(args.rounds + 1):  # round 0 warms up and is discarded

            def serialize() -> None:
                for r in records:
                    pickle.dumps(r, protocol=5)

            t_ser = timed(serialize)
            t_write = timed(lambda: write_synced(root / "blob", blob))
            t_build = timed(
                lambda: drt.cache(records, "bench-build", root=root, overwrite=True, progress=False)
            )
            t_ram = timed(
                lambda: drt.cache(records, "bench-build", root=ram, overwrite=True, progress=False)
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
            if round_ > 0:
                rows["serialize only"].append(t_ser)
                rows["write + fsync, same bytes"].append(t_write)
                rows["drt.cache"].append(t_build)
                rows["drt.cache, root in RAM"].append(t_ram)
                rows["drt.cache+meta"].append(t_meta)
                rows["drt.open"].append(t_open)

    print(f"\n{'step':<27}{'median s':>10}{'spread s':>10}{'records/s':>12}{'MB/s':>9}{'ratio':>8}")
    base = statistics.median(rows["serialize only"])
    for step, times in rows.items():
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
        "record and writes the Parquet table. 'write + fsync' writes as many bytes to the\n"
        "same disk, 4 MiB at a time, and syncs them: the disk's own rate. 'root in RAM'\n"
        "builds into tmpfs (/dev/shm), the same work without the file system's write path."
    )
    build_from_datasets(args)
    if args.compression:
        compare_compression(records, "images", args.rounds)
        compare_compression(make_tokens(args.records), "tokens", args.rounds)


def build_from_datasets(args: argparse.Namespace) -> None:
    """Builds the map-style dataset with ``num_proc`` 1 and 2 (and Ray on 2 CPUs).

    Each against reading and serializing it alone in one process, in the same round.
    """
    dataset = Generated(args.records, args.record_kb)
    nbytes = sum(len(pickle.dumps(dataset[i], protocol=5)) for i in range(min(1000, len(dataset))))
    nbytes = nbytes * len(dataset) // min(1000, len(dataset))
    print(f"\ndataset: {len(dataset):,} records of ~{nbytes / len(dataset) / 1024:.1f} KiB")
    steps = ["read + serialize", "num_proc=1", "num_proc=2"]
    if args.ray:
        import ray

        import dataset_rt.ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        steps.append("ray, 2 CPUs")
    rows: dict[str, list[float]] = {f"dataset: {step}": [] for step in steps}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            for round_ in range(args.rounds + 1):  # round 0 warms up and is discarded
                times: dict[str, float] = {}

                def read_and_serialize() -> None:
                    for i in range(len(dataset)):
                        pickle.dumps(dataset[i], protocol=5)

                times["read + serialize"] = timed(read_and_serialize)
                for k in (1, 2):
                    times[f"num_proc={k}"] = timed(
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
                    drt_dir = root / "bench-dataset"
                    if drt_dir.exists():
                        shutil.rmtree(drt_dir)
                if args.ray:
                    name = f"bench-ray-{round_}"
                    times["ray, 2 CPUs"] = timed(
                        lambda name=name: dataset_rt.ray.cache(
                            ray_dataset(args.records, args.record_kb),
                            name,
                            root=root,
                            metadata=["label"],
                            progress=False,
                        )
                    )
                    shutil.rmtree(root / name)
                if round_ > 0:
                    for step, t in times.items():
                        rows[f"dataset: {step}"].append(t)
    finally:
        if args.ray:
            ray.shutdown()
    base = statistics.median(rows["dataset: read + serialize"])
    print(f"{'step':<27}{'median s':>10}{'spread s':>10}{'records/s':>12}{'MB/s':>9}{'ratio':>8}")
    for step, times_ in rows.items():
        med = statistics.median(times_)
        print(
            f"{step:<27}{med:>10.3f}{max(times_) - min(times_):>10.3f}"
            f"{args.records / med:>12,.0f}{nbytes / med / 1e6:>9.0f}{base / med:>8.2f}"
        )
    print(
        "ratio = reading and serializing the dataset in one process / step time\n"
        "(num_proc=k target: >= 0.85 k on k free cores)"
    )


def compare_compression(records: list[dict[str, Any]], label: str, rounds: int) -> None:
    """Builds ``records`` uncompressed, with zstd and with lz4, and reads each back."""
    print(f"\ncompression, {label}: {len(records):,} records")
    codecs: list[Any] = [None, "zstd", "lz4"]
    build: dict[str, list[float]] = {str(c): [] for c in codecs}
    read: dict[str, list[float]] = {str(c): [] for c in codecs}
    on_disk: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for round_ in range(rounds + 1):
            for codec in codecs:
                name = f"bench-{codec}"
                t = timed(
                    lambda codec=codec, name=name: drt.cache(
                        records, name, root=root, compression=codec, overwrite=True, progress=False
                    )
                )
                cache = drt.open(name, root=root)
                on_disk[str(codec)] = cache.nbytes / cache.nbytes_on_disk
                loader = cache.metadata.drt.loader(batch_size=256, seed=round_, collate=list)
                r = timed(lambda loader=loader: sum(len(b) for b in loader))
                if round_ > 0:
                    build[str(codec)].append(t)
                    read[str(codec)].append(r)
    n = len(records)
    base_build, base_read = statistics.median(build["None"]), statistics.median(read["None"])
    print(
        f"{'codec':<8}{'ratio':>8}{'build rec/s':>13}{'vs none':>9}"
        f"{'read rec/s':>12}{'vs none':>9}{'spread s':>10}"
    )
    for codec in build:
        b, r = statistics.median(build[codec]), statistics.median(read[codec])
        print(
            f"{codec:<8}{on_disk[codec]:>7.2f}x{n / b:>13,.0f}{base_build / b:>9.2f}"
            f"{n / r:>12,.0f}{base_read / r:>9.2f}{max(read[codec]) - min(read[codec]):>10.3f}"
        )
    print("ratio = serialized bytes / bytes on disk; read: one shuffled loader pass, decoded")


if __name__ == "__main__":
    main()

"""A cache in object storage, read in place, against the same cache on local disk.

Starts moto's S3 server on 127.0.0.1 (the test suite's server; a Python process, so its
throughput, not the network's, bounds the first epoch here), builds a cache of ``--rows``
small records with ``drt.cache(root="s3://...")``, and measures:

- opening it from another local directory and having its metadata ready, against opening
  the local cache and reading its metadata;
- the bytes that metadata-only work fetched (open, table, filter, ``summary``, re-weight),
  file by file: the metadata files alone, no shard;
- a weighted loader's first epoch (the index and every shard fetched on demand, shards
  ahead of the batches) and second epoch (read from the local copy), as draws/s against
  the same loader over the local cache, and the bytes fetched over both epochs against
  those of the files the epochs read: each once;
- the same first epoch with a transform that holds the GIL (pure-Python arithmetic per
  record) against that loader on local disk: the native reader asks Python for each shard
  it lacks (through ``LocalCopy.fetch``), so a training loop that keeps the GIL busy could
  slow its fetches. The ratio beside the plain one says whether it does.
"""

from __future__ import annotations

import argparse
import atexit
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

import dataset_rt as drt
from dataset_rt import fetch


def start_server() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    atexit.register(server.terminate)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/").close()
            return endpoint
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the moto server did not start")


def records(n: int, nbytes: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, n)
    return [
        {"tokens": rng.integers(0, 255, nbytes, dtype=np.uint8), "label": int(labels[i])}
        for i in range(n)
    ]


def files_in(path: Path) -> dict[str, int]:
    return {
        str(p.relative_to(path)): p.stat().st_size
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def cache_shards(work: Path) -> int:
    return drt.open("local", root=work / "disk").num_shards


def busy(record: object) -> object:
    """A transform that holds the GIL for a while per record (pure Python arithmetic)."""
    total = 0
    for i in range(400):
        total += i * i
    return record


def epoch_rate(frame: pl.DataFrame, draws: int, epoch: int, transform: Any = None) -> float:
    loader = frame.drt.loader(
        batch_size=256, seed=0, num_samples=draws, collate=list, transform=transform
    )
    loader.set_epoch(epoch)
    start = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--record-bytes", type=int, default=200)
    parser.add_argument("--draws", type=int, default=200_000, help="draws per epoch")
    parser.add_argument("--shard-mb", type=float, default=None, help="shard size (default drt's)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.draws = 3000, 3000

    import boto3

    endpoint = start_server()
    options = {
        "aws_endpoint_url": endpoint,
        "aws_access_key_id": "bench",
        "aws_secret_access_key": "bench",
        "aws_region": "us-east-1",
        "aws_allow_http": "true",
    }
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        region_name="us-east-1",
    ).create_bucket(Bucket="bench")
    url = "s3://bench/caches"

    shards = {} if args.shard_mb is None else {"shard_size": int(args.shard_mb * (1 << 20))}
    with tempfile.TemporaryDirectory(prefix="drt-bench-remote-") as scratch:
        work = Path(scratch)
        os.environ["DATASET_RT_HOME"] = str(work / "home")
        data = records(args.rows, args.record_bytes)
        start = time.perf_counter()
        drt.cache(
            data,
            "local",
            root=work / "disk",
            progress=False,
            metadata=lambda r: {"label": r["label"]},
            **shards,
        )
        build_local = time.perf_counter() - start
        start = time.perf_counter()
        drt.cache(
            data,
            "remote",
            root=url,
            storage_options=options,
            progress=False,
            metadata=lambda r: {"label": r["label"]},
            **shards,
        )
        build_remote = time.perf_counter() - start
        del data

        print(
            f"{args.rows:,} records of {args.record_bytes} B in {cache_shards(work)} shards; "
            "moto S3 server on 127.0.0.1"
        )
        print(
            f"{'build':<44}{build_local:>9.2f} s local, {build_remote:.2f} s to s3:// "
            f"(build + upload)"
        )

        start = time.perf_counter()
        reopened = drt.open("local", root=work / "disk")
        local_meta = reopened.metadata
        open_local = time.perf_counter() - start
        start = time.perf_counter()
        cache = drt.open("remote", root=url, storage_options=options, local_dir=work / "node")
        frame = cache.metadata
        open_remote = time.perf_counter() - start
        assert frame.height == local_meta.height == args.rows
        print(f"{'open + metadata ready, local disk':<44}{open_local * 1e3:>9.1f} ms")
        print(
            f"{'open + metadata ready, s3:// (cold copy)':<44}{open_remote * 1e3:>9.1f} ms"
            f"  ({open_remote / open_local:.1f}x local)"
        )

        frame.filter(pl.col("label") < 5).drt.summary(by="label")
        weighted = frame.with_columns(weight=pl.col("label").drt.balance())
        fetched = files_in(cache.path)
        shard_files = [f for f in fetched if "shards/" in f]
        print(
            f"{'bytes fetched by metadata-only work':<44}{sum(fetched.values()):>9,} B "
            f"in {len(fetched)} files, {len(shard_files)} of them shards:"
        )
        for file, size in fetched.items():
            print(f"    {file:<40}{size:>13,} B")

        local_weighted = local_meta.with_columns(weight=pl.col("label").drt.balance())
        baseline = epoch_rate(local_weighted, args.draws, 0)
        first = epoch_rate(weighted, args.draws, 0)
        copy = fetch.copy_for(cache.path)
        assert copy is not None
        after_first = copy.fetched
        second = epoch_rate(weighted, args.draws, 1)
        again = epoch_rate(local_weighted, args.draws, 1)
        print(
            f"{'weighted loader, local disk':<44}{baseline:>9,.0f} draws/s (epoch 0), "
            f"{again:,.0f} (epoch 1)"
        )
        print(
            f"{'weighted loader, s3://, first epoch':<44}{first:>9,.0f} draws/s  "
            f"({first / baseline:.2f}x local)"
        )
        print(
            f"{'weighted loader, s3://, second epoch':<44}{second:>9,.0f} draws/s  "
            f"({second / again:.2f}x local)"
        )
        shards = sum(p.stat().st_size for p in (cache.path / "shards").glob("*.bin"))
        others = sum(
            (cache.path / f).stat().st_size
            for f in copy.files
            if f not in copy.shards and (cache.path / f).exists()
        )
        print(
            f"{'bytes fetched on demand over two epochs':<44}{copy.fetched:>9,} B "
            f"(first epoch {after_first:,}): the shards read, {shards:,} B, and the index, "
            f"{others:,} B ({copy.fetched / max(shards + others, 1):.2f}x: each once)"
        )

        # The GIL question: a cold copy again, read by a loader whose transform keeps the
        # GIL busy in this thread while the reader thread needs it to fetch shards.
        cold = drt.open("remote", root=url, storage_options=options, local_dir=work / "node2")
        cold_weighted = cold.metadata.with_columns(weight=pl.col("label").drt.balance())
        busy_local = epoch_rate(local_weighted, args.draws, 0, busy)
        busy_first = epoch_rate(cold_weighted, args.draws, 0, busy)
        print(f"{'GIL-holding transform, local disk':<44}{busy_local:>9,.0f} draws/s (epoch 0)")
        print(
            f"{'GIL-holding transform, s3://, first epoch':<44}{busy_first:>9,.0f} draws/s  "
            f"({busy_first / busy_local:.2f}x local; {first / baseline:.2f}x without it)"
        )


if __name__ == "__main__":
    main()

"""The sampling program at scale: mixtures, a 3-phase schedule, re-weights and seen().

Three caches (web, code and books: 60/30/10 % of ``--rows`` tiny records) with a quality
score per sample. The baseline is today's loader with one weight column over the same
frame, built and read in the same process; every figure is printed with its ratio to it
(median of ``--rounds``, with the spread) or, for the shares, with the chi-squared test's
p-value against the phase's proportions.

    python bench/program.py                 # 10M rows, 1M draws per phase
    python bench/program.py --smoke         # tiny sizes: checks that it runs
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

import dataset_rt as drt
from dataset_rt import Phase

SOURCES = {"web": 0.6, "code": 0.3, "books": 0.1}
SHARES = [
    {"web": 0.2, "code": 0.2, "books": 0.6},
    {"web": 0.6, "code": 0.3, "books": 0.1},
    {"web": 0.1, "code": 0.8, "books": 0.1},
]
BATCH = 256


def build(rows: int, root: Path) -> pl.DataFrame:
    """The three caches' metadata, concatenated, with ``source``, ``quality`` and one
    mixture column per phase."""
    frames = []
    for source, share in SOURCES.items():
        n = max(1, int(rows * share))
        cache = drt.cache(
            (b"%d" % i for i in range(n)), f"bench-{source}", root=root, progress=False
        )
        quality = pl.Series("quality", (np.arange(n) % 4 + 1).astype(np.float64))
        frames.append(cache.metadata.with_columns(quality, source=pl.lit(source)))
    frame = pl.concat(frames)
    return frame.with_columns(
        [
            pl.col("source").drt.mix(shares, weight="quality").alias(f"w{i}")
            for i, shares in enumerate(SHARES)
        ]
    ).with_columns(weight=pl.col("w1"))


def timed(fn: Callable[[], Any], rounds: int) -> list[float]:
    fn()  # warm-up, excluded: page cache, allocator
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def cell(times: list[float], base: list[float] | None = None, unit: float = 1e3) -> str:
    median = statistics.median(times)
    text = f"{median * unit:10.1f} ms ±{(max(times) - min(times)) * unit:6.1f}"
    if base is not None:
        text += f"   {median / statistics.median(base):5.2f}x the baseline"
    return text


def chi2_p(counts: dict[str, int], shares: dict[str, float]) -> float:
    n = sum(counts.values())
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in shares.items())
    return math.exp(-stat / 2)  # chi-squared with 2 degrees of freedom


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=float, default=1e7)
    parser.add_argument("--draws", type=float, default=1e6)
    parser.add_argument("--stream-draws", type=float, default=2e5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.draws, args.stream_draws, args.rounds = 3000, 20_000, 5_000, 1
    rows, draws, stream = int(args.rows), int(args.draws), int(args.stream_draws)
    rounds = args.rounds

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        frame = build(rows, Path(tmp))
        print(f"{frame.height:,} rows in 3 caches, built in {time.perf_counter() - start:.1f} s")
        schedule = [Phase("w0", until=draws), Phase("w1", until=2 * draws), Phase("w2")]
        options: dict[str, Any] = {
            "batch_size": BATCH,
            "seed": 1,
            "num_samples": draws,
            "collate": list,
            "history": Path(tmp) / "history",
        }

        print(f"\nshares of {draws:,} draws per phase (3 phases, one epoch each)")
        scheduled = frame.drt.loader(schedule=schedule, **options)
        sources = frame.select("cache_id", "sample_id", "source")
        for epoch, shares in enumerate(SHARES):
            seen = scheduled.seen(epoch=epoch, all_ranks=True)
            counts = dict(
                seen.join(sources, on=["cache_id", "sample_id"]).group_by("source").len().rows()
            )
            got = ", ".join(
                f"{k} {counts.get(k, 0) / seen.height:.4f} ({p})" for k, p in shares.items()
            )
            print(f"  phase {epoch}: {got}   chi-squared p = {chi2_p(counts, shares):.3f}")

        print("\nopen + first batch (a fresh loader over the frame)")
        plain_times = timed(lambda: next(iter(frame.drt.loader(**options))), rounds)
        program_times = timed(
            lambda: next(iter(frame.drt.loader(schedule=schedule, **options))), rounds
        )
        print(f"  baseline: one weight column   {cell(plain_times)}")
        print(f"  3-phase schedule              {cell(program_times, plain_times)}")

        print(f"\na step's draws: {stream:,} draws in batches of {BATCH}, in phase 1")
        plain = frame.drt.loader(**options)
        phased = frame.drt.loader(schedule=schedule, **options)
        phased.set_epoch(1)
        steps = stream // BATCH

        def read(loader: drt.Loader) -> None:
            for i, _ in enumerate(loader):
                if i + 1 == steps:
                    break

        plain_stream = timed(lambda: read(plain), rounds)
        phased_stream = timed(lambda: read(phased), rounds)
        rate = steps * BATCH / statistics.median(plain_stream)
        print(f"  baseline: one weight column   {cell(plain_stream)}   {rate:,.0f} draws/s")
        print(f"  3-phase schedule              {cell(phased_stream, plain_stream)}")

        print(f"\nreweight with a new {rows:,}-row weight vector, until in force")
        rng = np.random.default_rng(0)
        vectors = {
            "mixture x quality": frame["w2"] * (1.0 + frame["quality"]),
            "per-sample losses (random)": pl.Series(rng.gamma(2.0, 1.0, frame.height)),
        }
        for label, vector in vectors.items():
            reweights: list[float] = []

            def reweight(vector: pl.Series = vector, reweights: list[float] = reweights) -> None:
                loader = frame.drt.loader(schedule=schedule, **options)
                start = time.perf_counter()
                loader.reweight(vector)
                next(iter(loader))
                reweights.append(time.perf_counter() - start)
                loader.state_dict()  # waits for the history's copy, outside the timing

            timed(reweight, rounds)
            print(f"  {label:28}  {cell(reweights[1:])}   (target ≤ 300 ms)")

        print(f"\nseen() for {draws:,} draws")
        seen_times = timed(lambda: scheduled.seen(all_ranks=True), rounds)
        print(f"  seen(all_ranks=True)          {cell(seen_times)}   (target ≤ 100 ms)")


if __name__ == "__main__":
    main()

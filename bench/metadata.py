"""Metadata speed: balance + filter + normalize on a large table, next to native Polars.

The baseline computes the same weights with plain Polars expressions
(``1 / pl.len().over("label")`` and a division by the sum) in the same process; the ratio is
baseline time / dataset_rt time (above 1 means the plugin is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import polars as pl

import dataset_rt  # noqa: F401 - registers the .drt namespace


def table(rows: int, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    p = np.array([0.3, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03])
    return pl.DataFrame(
        {
            "cache_id": pl.repeat("0123456789ab", rows, eager=True),
            "sample_id": np.arange(rows, dtype=np.int64),
            "label": rng.choice(10, size=rows, p=p).astype(np.int64),
            "ink": rng.integers(0, 1000, size=rows),
            "weight": np.ones(rows),
        }
    )


def plugin(df: pl.DataFrame) -> pl.DataFrame:
    return (
        df.lazy()
        .filter(pl.col("ink") >= 100)
        .with_columns(weight=pl.col("label").drt.balance())
        .with_columns(p=pl.col("weight").drt.normalize())
        .collect()
    )


def native(df: pl.DataFrame) -> pl.DataFrame:
    return (
        df.lazy()
        .filter(pl.col("ink") >= 100)
        .with_columns(weight=1 / pl.len().over("label"))
        .with_columns(weight=pl.col("weight") * pl.len() / pl.col("weight").sum())
        .with_columns(p=pl.col("weight") / pl.col("weight").sum())
        .collect()
    )


def measure(
    fn: Callable[[pl.DataFrame], pl.DataFrame], df: pl.DataFrame, rounds: int
) -> list[float]:
    fn(df)  # warm-up, excluded
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(df)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    df = table(args.rows)
    a, b = plugin(df), native(df)
    assert np.allclose(a["p"].to_numpy(), b["p"].to_numpy()), "the two computations disagree"
    print(
        f"{args.rows:,} rows; filter ink >= 100, balance by label, normalize; {args.rounds} rounds"
    )
    base = measure(native, df, args.rounds)
    ours = measure(plugin, df, args.rounds)
    print(f"{'':<34}{'median s':>10}{'spread s':>10}{'ratio':>8}")
    for label, times in (
        ("native Polars (1 / len().over)", base),
        (".drt.balance + .drt.normalize", ours),
    ):
        med = statistics.median(times)
        print(
            f"{label:<34}{med:>10.3f}{max(times) - min(times):>10.3f}"
            f"{statistics.median(base) / med:>8.2f}"
        )


if __name__ == "__main__":
    main()

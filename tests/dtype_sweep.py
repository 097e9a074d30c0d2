"""Runs every ``.drt`` expression and frame method on a column of every Polars dtype.

Run as a script by ``test_dtypes.py``, in a process of its own so that an abort is seen as
one: it prints one JSON line per case, ``{"case", "dtype", "column", "outcome", "error",
"message"}``, where ``column`` is the name the probe column has in the case (its role's:
``weight``, ``sample_id``, ``cache_id``; else ``probe``), ``outcome`` is ``"ok"`` or
``"error"``, and ``error`` names the exception's class and whether it is a dataset_rt or a
Polars error.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import polars as pl

import dataset_rt as drt
from dataset_rt.errors import DatasetRTError

COLUMN = "probe"  # the column every case feeds a dtype through; errors must name it


def columns() -> dict[str, pl.Series]:
    """One three-row column per dtype (the name of the entry says which)."""

    def s(values: list[Any], dtype: Any = None) -> pl.Series:
        return pl.Series(COLUMN, values, dtype=dtype)

    out = {
        "Null": s([None, None, None], pl.Null),
        "Boolean": s([True, False, True]),
        "Float32": s([1.0, 2.0, 1.0], pl.Float32),
        "Float64": s([1.0, 2.0, 1.0]),
        "Float64 all null": s([None, None, None], pl.Float64),
        "Float64 with NaN": s([1.0, float("nan"), 1.0]),
        "Decimal": s([Decimal("1.5"), Decimal("2.0"), Decimal("1.5")], pl.Decimal(10, 2)),
        "String": s(["a", "b", "a"]),
        "String all null": s([None, None, None], pl.String),
        "Binary": s([b"a", b"b", b"a"]),
        "Date": s([dt.date(2024, 1, d) for d in (1, 2, 1)]),
        "Datetime UTC": s([dt.datetime(2024, 1, d) for d in (1, 2, 1)]).dt.replace_time_zone("UTC"),
        "Duration": s([dt.timedelta(seconds=d) for d in (1, 2, 1)]),
        "Time": s([dt.time(d) for d in (1, 2, 1)]),
        "Categorical": s(["a", "b", "a"], pl.Categorical),
        "Enum": s(["a", "b", "a"], pl.Enum(["a", "b"])),
        "List": s([[1], [2, 3], [1]]),
        "Array": s([[1, 2], [3, 4], [1, 2]], pl.Array(pl.Int64, 2)),
        "Struct": s([{"a": 1}, {"a": 2}, {"a": 1}]),
        "Object": s([object(), object(), object()], pl.Object),
    }
    for name in ("Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64"):
        out[name] = s([1, 2, 1], getattr(pl, name))
    if hasattr(pl, "Int128"):
        out["Int128"] = s([1, 2, 1], pl.Int128)
    if hasattr(pl, "Extension"):  # Polars 2
        out["Extension"] = s([1, 2, 1]).cast(pl.Extension("demo.ext", pl.Int64))
    return out


def collect_streaming(lazy: pl.LazyFrame) -> pl.DataFrame:
    return lazy.collect(engine="streaming")


def expression_cases() -> dict[str, Callable[[], pl.Expr]]:
    c = pl.col(COLUMN)
    return {
        "normalize": lambda: c.drt.normalize(),
        "effective_size": lambda: c.drt.effective_size(),
        "balance": lambda: c.drt.balance(),
        "balance(weight=)": lambda: pl.col("key").drt.balance(weight=COLUMN),
        "split": lambda: c.drt.split({"a": 0.5, "b": 0.5}),
        "draws": lambda: c.drt.draws(),
        "mix": lambda: c.drt.mix({"a": 1, "b": 1, "1": 1, "2": 1}),
        "mix(weight=)": lambda: pl.col("key").drt.mix({0: 1, 1: 1}, weight=COLUMN),
    }


def frame_cases(cache: drt.Cache) -> dict[str, Callable[[pl.DataFrame], Any]]:
    """Frame methods, each fed the probe column in one role."""

    def as_weight(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.with_columns(
            cache_id=pl.lit(cache.cache_id), sample_id=pl.int_range(pl.len()), weight=COLUMN
        )

    def as_ids(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.with_columns(cache_id=pl.lit(cache.cache_id), sample_id=COLUMN, weight=1.0)

    def as_cache_ids(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.with_columns(cache_id=COLUMN, sample_id=pl.int_range(pl.len()), weight=1.0)

    def first_batch(frame: pl.DataFrame, **options: Any) -> Any:
        return next(iter(frame.drt.loader(batch_size=2, collate=list, **options)))

    return {
        "summary(by=)": lambda f: f.with_columns(weight=1.0).drt.summary(by=COLUMN),
        "summary(weight=)": lambda f: f.drt.summary(by="key", weight=COLUMN),
        "lazy summary(by=)": lambda f: collect_streaming(
            f.lazy().with_columns(weight=1.0).drt.summary(by=COLUMN)
        ),
        "plot(by=)": lambda f: f.with_columns(weight=1.0).drt.plot(COLUMN),
        "epoch (weight)": lambda f: as_weight(f).drt.epoch(),
        "loader (weight)": lambda f: first_batch(as_weight(f)),
        "loader (sample_id)": lambda f: first_batch(as_ids(f)),
        "loader (cache_id)": lambda f: first_batch(as_cache_ids(f)),
        "evaluation loader (sample_id)": lambda f: first_batch(as_ids(f), shuffle=False),
        "records (sample_id)": lambda f: as_ids(f).drt.records(2),
    }


def role(case: str) -> str:
    """The name the probe column has in a case: its role's column, or its own name."""
    for name in ("weight", "sample_id", "cache_id"):
        if f"({name})" in case:
            return name
    return COLUMN


def outcome(case: str, dtype: str, run: Callable[..., Any], *args: Any) -> dict[str, Any]:
    try:
        run(*args)
    # Every exception is reported, the test judges them: a panic inside Polars itself raises
    # pyo3's PanicException, a BaseException.
    except (Exception, BaseException) as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        kind = (
            "dataset_rt"
            if isinstance(exc, DatasetRTError)
            else "polars"
            if isinstance(exc, pl.exceptions.PolarsError)
            else "other"
        )
        return {
            "case": case,
            "dtype": dtype,
            "column": role(case),
            "outcome": "error",
            "error": f"{kind}:{type(exc).__name__}",
            "message": str(exc),
        }
    return {"case": case, "dtype": dtype, "column": role(case), "outcome": "ok", "error": None}


def eager(frame: pl.DataFrame, make: Callable[[], pl.Expr]) -> pl.DataFrame:
    return frame.select(make())


def streaming(frame: pl.DataFrame, make: Callable[[], pl.Expr]) -> pl.DataFrame:
    return collect_streaming(frame.lazy().select(make()))


def sweep(dtype: str, frame: pl.DataFrame, cache: drt.Cache) -> None:
    """Prints the outcome of every case on one frame."""
    for name, make in expression_cases().items():
        for engine in (eager, streaming):
            case = f"{name} [{engine.__name__}]"
            print(json.dumps(outcome(case, dtype, engine, frame, make)))
    for name, call in frame_cases(cache).items():
        print(json.dumps(outcome(name, dtype, call, frame)), flush=True)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    cache = drt.cache(range(3), "dtype-sweep", progress=False)
    for label, column in columns().items():
        for rows in (3, 0):
            frame = pl.DataFrame([column[:rows], pl.Series("key", [0, 1, 0][:rows])])
            sweep(label if rows else f"{label}, empty", frame, cache)
    print("done", flush=True)


if __name__ == "__main__":
    main()

"""Looking at a metadata frame: per-group summary, a chart, and the records behind rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl

from dataset_rt import plugins
from dataset_rt._version_check import POLARS_2
from dataset_rt.caches import open_by_id
from dataset_rt.errors import ArgumentError
from dataset_rt.metadata import link_columns
from dataset_rt.roots import PathLike

__all__ = ["plot", "records", "summary"]


# Polars 1 cannot group by fixed-size arrays: it panics.
_UNGROUPABLE = (pl.Object,) if POLARS_2 else (pl.Object, pl.Array)


def _columns(frame: pl.LazyFrame, by: str | Sequence[str]) -> list[str]:
    columns = [by] if isinstance(by, str) else list(by)
    if not columns or not all(isinstance(c, str) for c in columns):
        raise ArgumentError(f"by must be a column name or a list of them, got {by!r}")
    schema = frame.collect_schema()
    for column in columns:
        dtype = schema.get(column)
        if dtype is not None and isinstance(dtype, _UNGROUPABLE):
            raise ArgumentError(
                f"cannot group by column {column!r} of dtype {dtype} (Polars {pl.__version__} "
                "has no grouping for it); group by a column derived from it instead"
            )
    return columns


def summary(
    frame: pl.LazyFrame,
    by: str | Sequence[str],
    *,
    weight: str = "weight",
    num_samples: int | None = None,
) -> pl.LazyFrame:
    """Per-group counts, shares and expected draws per epoch; see ``df.drt.summary``."""
    columns = _columns(frame, by)
    if num_samples is not None and (isinstance(num_samples, bool) or num_samples < 1):
        raise ArgumentError(f"num_samples must be a positive integer, got {num_samples!r}")
    draws = pl.lit(num_samples) if num_samples is not None else pl.col("samples").sum()
    return (
        frame.select(*columns, _p=plugins.normalize(weight))
        .group_by(columns)
        .agg(samples=pl.len(), weight_share=pl.col("_p").sum())
        .with_columns(natural_share=pl.col("samples") / pl.col("samples").sum())
        .with_columns(
            expected_draws=pl.col("weight_share") * draws,
            boost=pl.col("weight_share") / pl.col("natural_share"),
        )
        .select(*columns, "samples", "natural_share", "weight_share", "expected_draws", "boost")
        .sort(columns, nulls_last=True)
    )


def plot(frame: pl.LazyFrame, by: str, *, weight: str = "weight") -> Any:
    """Bar chart of the natural vs. the weighted share of each group; returns the Figure."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("df.drt.plot draws with matplotlib: pip install matplotlib") from exc
    table = summary(frame, by, weight=weight).collect()
    labels = [str(v) for v in table[by].to_list()]
    positions = range(len(labels))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(labels) + 2), 3.5), layout="constrained")
    ax.bar([p - width / 2 for p in positions], table["natural_share"], width, label="natural")
    ax.bar([p + width / 2 for p in positions], table["weight_share"], width, label="weighted")
    ax.set_xticks(list(positions), labels)
    ax.set_xlabel(by)
    ax.set_ylabel("share of draws")
    ax.set_title(f"{by}: natural vs. weighted sampling")
    # Beside the axes, where no bar can be under it; the layout makes room for it.
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    # Closed for pyplot: a notebook shows the returned Figure once, instead of also drawing
    # every figure pyplot holds at the end of the cell; save it with fig.savefig(...).
    plt.close(fig)
    return fig


def records(frame: pl.LazyFrame, n: int = 5, *, root: PathLike | None = None) -> list[Any]:
    """The decoded records behind the first ``n`` rows, in row order."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ArgumentError(f"n must be a non-negative integer, got {n!r}")
    names = frame.collect_schema().names()
    links = [c for c in ("cache_id", "sample_id") if c in names]
    cache_ids, ids = link_columns(frame.select(links).head(n).collect())
    caches = {cid: open_by_id(cid, root) for cid in cache_ids.unique().to_list()}
    return [caches[cid].get(sid) for cid, sid in zip(cache_ids, ids, strict=True)]

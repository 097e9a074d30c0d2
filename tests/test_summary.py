"""df.drt.summary, df.drt.plot and the frame namespaces, eager and lazy."""

from __future__ import annotations

import polars as pl
import pytest

import dataset_rt as drt


@pytest.fixture
def frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            "cache_id": ["c"] * 6,
            "sample_id": range(6),
            "label": ["a", "a", "a", "a", "b", None],
            "weight": [1.0, 1.0, 1.0, 1.0, 2.0, 2.0],
        }
    )


def test_summary_counts_shares_and_expected_draws(frame: pl.DataFrame) -> None:
    table = frame.drt.summary(by="label")
    assert table.columns == [
        "label", "samples", "natural_share", "weight_share", "expected_draws", "boost"
    ]  # fmt: skip
    assert table["label"].to_list() == ["a", "b", None]
    assert table["samples"].to_list() == [4, 1, 1]
    assert table["natural_share"].to_list() == pytest.approx([4 / 6, 1 / 6, 1 / 6])
    assert table["weight_share"].to_list() == pytest.approx([0.5, 0.25, 0.25])
    assert table["expected_draws"].to_list() == pytest.approx([3.0, 1.5, 1.5])
    assert table["boost"].to_list() == pytest.approx([0.75, 1.5, 1.5])
    per_epoch = frame.drt.summary(by="label", num_samples=1000)
    assert per_epoch["expected_draws"].to_list() == pytest.approx([500, 250, 250])
    lazy = frame.lazy().drt.summary(by=["label"])
    assert isinstance(lazy, pl.LazyFrame)
    assert lazy.collect().equals(table)


def test_summary_after_balance_shows_equal_shares(frame: pl.DataFrame) -> None:
    balanced = frame.with_columns(weight=pl.col("label").drt.balance())
    shares = balanced.drt.summary("label")["weight_share"].to_list()
    assert shares == pytest.approx([1 / 3] * 3)


def test_summary_rejects_bad_input(frame: pl.DataFrame) -> None:
    with pytest.raises(drt.errors.ArgumentError, match="by must be"):
        frame.drt.summary(by=[])
    with pytest.raises(drt.errors.ArgumentError, match="num_samples"):
        frame.drt.summary(by="label", num_samples=0)
    with pytest.raises(pl.exceptions.ComputeError, match="holds -1"):
        frame.with_columns(weight=pl.lit(-1.0)).drt.summary(by="label")


def test_plot_draws_natural_and_weighted_bars(frame: pl.DataFrame) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = frame.with_columns(weight=pl.col("label").drt.balance()).drt.plot(by="label")
    assert isinstance(fig, matplotlib.figure.Figure)
    assert not plt.get_fignums(), "pyplot must not hold the figure (a notebook would draw it twice)"
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "None"]
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["natural", "weighted"]
    heights = [round(p.get_height(), 6) for p in ax.patches]
    assert heights == [round(4 / 6, 6), round(1 / 6, 6), round(1 / 6, 6)] + [round(1 / 3, 6)] * 3
    fig.draw_without_rendering()
    axes_box, legend_box = ax.get_window_extent(), legend.get_window_extent()
    assert legend_box.x0 >= axes_box.x1, "the legend sits beside the axes, not over the bars"
    assert legend_box.x1 <= fig.bbox.x1, "and inside the figure"


def test_records_rejects_bad_n(frame: pl.DataFrame) -> None:
    with pytest.raises(drt.errors.ArgumentError, match="n must be"):
        frame.drt.records(n=-1)

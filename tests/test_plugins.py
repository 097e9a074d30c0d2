"""The Rust expression plugins, through the .drt namespace, eager, lazy and streaming."""

from __future__ import annotations

import ctypes

import polars as pl
import pytest
from polars.exceptions import ComputeError

import dataset_rt as drt
from dataset_rt import plugins

PLUGIN_FUNCTIONS = ["normalize"]


def test_every_plugin_function_is_exported_from_the_native_module() -> None:
    lib = ctypes.CDLL(str(plugins.PLUGIN_PATH))
    assert hasattr(lib, "_polars_plugin_get_version")
    for name in PLUGIN_FUNCTIONS:
        assert hasattr(lib, f"_polars_plugin_{name}"), name
        assert callable(getattr(plugins, name)), name
    public = {n for n in plugins.__all__ if n != "PLUGIN_PATH"}
    assert public == set(PLUGIN_FUNCTIONS), "a plugin function is missing from this test"


def test_normalize_eager_and_lazy() -> None:
    df = pl.DataFrame({"weight": [1.0, 3.0, 0.0, 4.0]})
    expected = [0.125, 0.375, 0.0, 0.5]
    assert df.select(pl.col("weight").drt.normalize())["weight"].to_list() == expected
    lazy = df.lazy().with_columns(p=pl.col("weight").drt.normalize()).collect()
    assert lazy["p"].to_list() == expected
    streamed = df.lazy().select(pl.col("weight").drt.normalize()).collect(engine="streaming")
    assert streamed["weight"].to_list() == expected
    assert df.select(plugins.normalize("weight"))["weight"].to_list() == expected


def test_normalize_integer_weights_and_groups() -> None:
    df = pl.DataFrame({"label": ["a", "a", "b"], "w": [1, 3, 5]})
    per_group = df.with_columns(p=pl.col("w").drt.normalize().over("label"))
    assert per_group["p"].to_list() == [0.25, 0.75, 1.0]
    agg = df.group_by("label", maintain_order=True).agg(pl.col("w").drt.normalize())
    assert agg["w"].to_list() == [[0.25, 0.75], [1.0]]


def test_normalize_on_a_cache_metadata_table() -> None:
    c = drt.cache(range(4), "norm", metadata=lambda i: {"weight": i}, progress=False)
    p = c.metadata.select(pl.col("weight").drt.normalize())["weight"]
    assert p.to_list() == [0.0, 1 / 6, 2 / 6, 3 / 6]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.0, -1.0], "holds -1 at row 1"),
        ([1.0, float("nan")], "holds NaN at row 1"),
        ([float("inf")], "holds inf at row 0"),
        ([1.0, None], "is null at row 1"),
        ([0.0, 0.0], "sums to zero"),
    ],
)
def test_normalize_rejects_bad_weights(values: list[float | None], message: str) -> None:
    df = pl.DataFrame({"weight": values}, schema={"weight": pl.Float64})
    with pytest.raises(ComputeError, match=f"weight column 'weight' {message}"):
        df.select(pl.col("weight").drt.normalize())


def test_normalize_rejects_non_numeric_columns() -> None:
    df = pl.DataFrame({"weight": ["heavy"]})
    with pytest.raises(ComputeError, match="weight column 'weight' must be numeric, not str"):
        df.select(pl.col("weight").drt.normalize())

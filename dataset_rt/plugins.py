"""The Rust expression plugins, as functions returning ``pl.Expr``.

These are what the ``.drt`` namespace calls; they are also usable directly:
``dataset_rt.plugins.normalize(pl.col("weight"))``.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from polars.plugins import register_plugin_function

from dataset_rt import _native

__all__ = ["PLUGIN_PATH", "normalize"]

PLUGIN_PATH = Path(_native.__file__)
"""The native module's file, which also exports the plugin functions."""


def normalize(weight: pl.Expr | str) -> pl.Expr:
    """Probabilities proportional to ``weight``, summing to 1.

    Raises (when the expression runs) a ``ComputeError`` naming the row for a negative,
    NaN, infinite or null weight, or when all weights are zero.
    """
    return register_plugin_function(
        plugin_path=PLUGIN_PATH,
        function_name="normalize",
        args=[pl.col(weight) if isinstance(weight, str) else weight],
        is_elementwise=False,
    )

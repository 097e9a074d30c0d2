"""The ``.drt`` namespace registered on Polars expressions when dataset_rt is imported."""

from __future__ import annotations

import polars as pl

from dataset_rt import plugins

__all__ = ["DrtExprNamespace"]


@pl.api.register_expr_namespace("drt")
class DrtExprNamespace:
    """dataset_rt's expressions: ``pl.col("weight").drt.normalize()``."""

    def __init__(self, expr: pl.Expr) -> None:
        self._expr = expr

    def normalize(self) -> pl.Expr:
        """Probabilities proportional to this column, summing to 1.

        Examples
        --------
        >>> import polars as pl, dataset_rt
        >>> pl.DataFrame({"weight": [1.0, 3.0]}).select(pl.col("weight").drt.normalize())
        shape: (2, 1)
        ┌────────┐
        │ weight │
        │ ---    │
        │ f64    │
        ╞════════╡
        │ 0.25   │
        │ 0.75   │
        └────────┘
        """
        return plugins.normalize(self._expr)

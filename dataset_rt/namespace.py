"""The ``.drt`` namespaces registered on Polars expressions and frames by ``import dataset_rt``.

Type checkers do not see namespaces registered at runtime; the functions in
:mod:`dataset_rt.plugins` are the typed equivalents of the expression namespace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

import polars as pl

from dataset_rt import plugins, summary
from dataset_rt.loader import Loader, loader_signature
from dataset_rt.program import Phase, epoch_frame
from dataset_rt.roots import PathLike
from dataset_rt.streams import TokenLoader

__all__ = ["DrtExprNamespace", "DrtFrameNamespace", "DrtLazyFrameNamespace"]


@pl.api.register_expr_namespace("drt")
class DrtExprNamespace:
    """dataset_rt's expressions: ``pl.col("label").drt.balance()`` and friends."""

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

    def balance(
        self, *more: plugins.IntoExpr, power: float = 1.0, weight: plugins.IntoExpr | None = None
    ) -> pl.Expr:
        """Weights that equalise the groups of this column (and ``more`` columns).

        ``power=1`` gives every group the same total weight, ``power=0`` keeps the natural
        distribution, values in between temper it; see :func:`dataset_rt.plugins.balance`.

        Examples
        --------
        >>> import polars as pl, dataset_rt
        >>> df = pl.DataFrame({"label": ["a", "a", "a", "b"]})
        >>> df.select(pl.col("label").drt.balance())["label"].to_list()
        [0.6666666666666666, 0.6666666666666666, 0.6666666666666666, 2.0]
        """
        return plugins.balance(self._expr, *more, power=power, weight=weight)

    def mix(
        self, shares: Mapping[str | int, float], *, weight: plugins.IntoExpr | None = None
    ) -> pl.Expr:
        """Probabilities that give each group of this column exactly its share of the draws.

        Within a group, rows keep the proportions of ``weight`` (equal without one); see
        :func:`dataset_rt.plugins.mix`.

        Examples
        --------
        >>> import polars as pl, dataset_rt
        >>> df = pl.DataFrame({"source": ["web", "web", "web", "code"], "w": [1, 1, 2, 1]})
        >>> mixed = df.with_columns(p=pl.col("source").drt.mix({"web": 0.5, "code": 0.5}))
        >>> mixed.group_by("source", maintain_order=True).agg(pl.col("p").sum()).rows()
        [('web', 0.5), ('code', 0.5)]
        >>> df.select(pl.col("source").drt.mix({"web": 0.5, "code": 0.5}, weight="w"))[
        ...     "source"
        ... ].to_list()
        [0.125, 0.125, 0.25, 0.5]
        """
        return plugins.mix(self._expr, shares, weight=weight)

    def split(self, fractions: Mapping[str, float], *, seed: int = 0) -> pl.Expr:
        """The split each id falls into, by a stable hash; see :func:`dataset_rt.plugins.split`.

        Examples
        --------
        >>> import polars as pl, dataset_rt
        >>> ids = pl.DataFrame({"sample_id": range(10_000)})
        >>> parts = ids.select(pl.col("sample_id").drt.split({"train": 0.9, "val": 0.1}))
        >>> parts["sample_id"].value_counts(sort=True)["count"].to_list()
        [8983, 1017]
        """
        return plugins.split(self._expr, fractions, seed=seed)

    def draws(self, n: int | None = None, *, seed: int = 0, epoch: int = 0) -> pl.Expr:
        """How many times a shuffling loader draws each row in an epoch of ``n`` draws.

        Computed by the same code as the loader, so it always matches what training sees;
        see :func:`dataset_rt.plugins.draws`.

        Examples
        --------
        >>> import polars as pl, dataset_rt
        >>> df = pl.DataFrame({"weight": [1.0, 0.0, 3.0]})
        >>> df.select(pl.col("weight").drt.draws(1000, seed=0)).sum().item()
        1000
        """
        return plugins.draws(self._expr, n, seed=seed, epoch=epoch)

    def effective_size(self) -> pl.Expr:
        """Kish's effective sample size of this weight column (an aggregation).

        Examples
        --------
        >>> import polars as pl, dataset_rt
        >>> pl.DataFrame({"w": [1.0, 1.0, 2.0]}).select(pl.col("w").drt.effective_size()).item()
        2.6666666666666665
        """
        return plugins.effective_size(self._expr)


class _FrameMethods:
    """What the DataFrame and LazyFrame namespaces share."""

    _lazy: pl.LazyFrame
    _frame: pl.DataFrame | pl.LazyFrame

    @overload
    def loader(self, batch_size: int, *, seq_len: int, **options: Any) -> TokenLoader: ...
    @overload
    def loader(self, batch_size: int, **options: Any) -> Loader: ...
    def loader(self, batch_size: int, **options: Any) -> Loader | TokenLoader:
        """A training loader over this frame's rows: ``Loader(frame, batch_size, **options)``.

        The options (``shuffle``, ``seed``, ``num_samples``, ``decode``, ``transform``,
        ``collate``, ``num_workers``, ``prefetch``, ``drop_last``, ``rank``, ``world_size``,
        ``root``, ``verify``, ``copy``, ``schedule``, ``history``) and their defaults are those of
        :class:`dataset_rt.Loader`, where each is described. With ``seq_len``, over rows of
        token caches, it is a :class:`dataset_rt.TokenLoader` of packed token sequences
        instead (options ``shuffle``, ``seed``, ``num_samples``, ``separator``, ``targets``,
        ``documents``, ``rank``, ``world_size``, ``root``, ``verify``, ``schedule``,
        ``num_workers``, ``history``).
        """
        if "seq_len" in options:
            return TokenLoader(self._frame, batch_size, **options)
        return Loader(self._frame, batch_size, **options)

    def epoch(
        self,
        *,
        seed: int = 0,
        epoch: int = 0,
        num_samples: int | None = None,
        shuffle: bool = True,
        schedule: Sequence[Phase] | None = None,
    ) -> pl.DataFrame:
        """The rows one epoch draws, in draw order, with a ``draw`` position column.

        This is the global stream a loader with the same ``seed`` (and ``schedule``) reads
        in that epoch (ranks read it strided: rank ``r`` of ``w`` gets draws
        ``r, r + w, ...``). With a schedule, a ``phase`` column names each draw's phase.

        Examples
        --------
        >>> import polars as pl, dataset_rt as drt
        >>> df = pl.DataFrame({"a": [1.0, 0.0], "b": [0.0, 1.0]})
        >>> schedule = [drt.Phase("a", until=3), drt.Phase("b")]
        >>> df.drt.epoch(num_samples=5, schedule=schedule)["phase"].to_list()
        ['phase 0', 'phase 0', 'phase 0', 'phase 1', 'phase 1']
        """
        return epoch_frame(
            self._lazy,
            seed=seed,
            epoch=epoch,
            num_samples=num_samples,
            shuffle=shuffle,
            schedule=schedule,
        )

    def records(self, n: int = 5, *, root: PathLike | None = None) -> list[Any]:
        """Decodes the payloads behind the first ``n`` rows, to look at the samples of a query.

        Rows may come from several caches; each is read from its own cache, found by its
        ``cache_id`` among the caches opened in this process, or under ``root``.
        """
        return summary.records(self._lazy, n, root=root)


@pl.api.register_dataframe_namespace("drt")
class DrtFrameNamespace(_FrameMethods):
    """dataset_rt's methods on a metadata DataFrame: ``df.drt.summary(by="label")``."""

    def __init__(self, frame: pl.DataFrame) -> None:
        self._frame = frame
        self._lazy = frame.lazy()

    def summary(
        self, by: str | Sequence[str], *, weight: str = "weight", num_samples: int | None = None
    ) -> pl.DataFrame:
        """Per-group sample counts, natural and weighted shares, and expected draws.

        Columns: the ``by`` columns, ``samples``, ``natural_share`` (share of rows),
        ``weight_share`` (share of the total weight: the probability that a draw lands in
        the group), ``expected_draws`` (per epoch of ``num_samples`` draws, by default one
        per row) and ``boost`` (``weight_share / natural_share``).
        """
        return summary.summary(self._lazy, by, weight=weight, num_samples=num_samples).collect()

    def plot(self, by: str, *, weight: str = "weight") -> Any:
        """Draws the natural vs. weighted distribution of ``by`` (matplotlib); returns the Figure.

        A notebook shows the figure once; elsewhere save it with ``fig.savefig(path)``.
        """
        return summary.plot(self._lazy, by, weight=weight)


@pl.api.register_lazyframe_namespace("drt")
class DrtLazyFrameNamespace(_FrameMethods):
    """dataset_rt's methods on a metadata LazyFrame."""

    def __init__(self, frame: pl.LazyFrame) -> None:
        self._frame = frame
        self._lazy = frame

    def summary(
        self, by: str | Sequence[str], *, weight: str = "weight", num_samples: int | None = None
    ) -> pl.LazyFrame:
        """The lazy version of ``DataFrame.drt.summary``."""
        return summary.summary(self._lazy, by, weight=weight, num_samples=num_samples)


# ``help(df.drt.loader)``, notebooks and IDEs show the options with their defaults.
_FrameMethods.loader.__signature__ = loader_signature()  # type: ignore[attr-defined]

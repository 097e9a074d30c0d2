"""The Rust expression plugins, as functions returning ``pl.Expr``.

The ``.drt`` namespace forwards to these; they can also be called directly, for example
``dataset_rt.plugins.balance("label", "source")``. All of them run inside Polars, eagerly or
lazily, in ``select``, ``with_columns``, ``filter``, ``group_by().agg()`` and ``over()``, and
with the streaming engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from pathlib import Path

import polars as pl
from polars.plugins import register_plugin_function

from dataset_rt import _native
from dataset_rt.errors import ArgumentError, WeightError

__all__ = [
    "PLUGIN_PATH",
    "balance",
    "draw_rows",
    "draws",
    "effective_size",
    "mix",
    "normalize",
    "split",
]

PLUGIN_PATH = Path(_native.__file__)
"""The native module's file, which also exports the plugin functions."""

IntoExpr = pl.Expr | str
"""A column name or an expression."""


def _expr(value: IntoExpr) -> pl.Expr:
    return pl.col(value) if isinstance(value, str) else value


def normalize(weight: IntoExpr) -> pl.Expr:
    """Probabilities proportional to ``weight``, summing to 1.

    Raises (when the expression runs) a ``ComputeError`` naming the row for a negative,
    NaN, infinite or null weight, or when all weights are zero.
    """
    return register_plugin_function(
        plugin_path=PLUGIN_PATH,
        function_name="normalize",
        args=[_expr(weight)],
        is_elementwise=False,
    )


def effective_size(weight: IntoExpr) -> pl.Expr:
    """Kish's effective sample size ``(Σw)² / Σw²``, an aggregation returning one value.

    It says how many equally weighted samples carry as much information as the weighted
    ones: ``n`` for uniform weights, down to 1 when one row holds all the weight.
    """
    return register_plugin_function(
        plugin_path=PLUGIN_PATH,
        function_name="effective_size",
        args=[_expr(weight)],
        is_elementwise=False,
        returns_scalar=True,
    )


def balance(*keys: IntoExpr, power: float = 1.0, weight: IntoExpr | None = None) -> pl.Expr:
    """Per-row weights that equalise the groups formed by ``keys``.

    Row ``i`` of group ``g`` gets ``w_i · W_g^(-power)``, where ``w_i`` is its ``weight``
    (1 without one) and ``W_g`` the group's total; the result is scaled so that it sums to
    what the input weights summed to. ``power=1`` gives every group the same total,
    ``power=0`` leaves the natural distribution, values in between temper it. Nulls form a
    group of their own.

    Parameters
    ----------
    *keys
        One or more columns (or a struct of them) whose combined values define the groups,
        of any dtype: integers, floats, booleans, strings, categoricals, enums, dates, ...
    power
        Between 0 and 1.
    weight
        Existing weights to rebalance, so that within each group rows keep their shares.
    """
    if not keys:
        raise ArgumentError("balance needs at least one column defining the groups")
    if isinstance(power, bool) or not isinstance(power, Real) or not 0.0 <= power <= 1.0:
        raise ArgumentError(
            f"power must be a number between 0 (natural) and 1 (equal groups), got {power!r}"
        )
    args = [_expr(k) for k in keys]
    if weight is not None:
        args.append(_expr(weight))
    return register_plugin_function(
        plugin_path=PLUGIN_PATH,
        function_name="balance",
        args=args,
        kwargs={"power": float(power), "weighted": weight is not None},
        is_elementwise=False,
    )


def mix(
    groups: IntoExpr, shares: Mapping[str | int, float], *, weight: IntoExpr | None = None
) -> pl.Expr:
    """Sampling probabilities that give each group of ``groups`` exactly its share of draws.

    Row ``i`` of group ``g`` gets ``s_g / Σs · w_i / W_g``, where ``s_g`` is the group's
    share, ``w_i`` the row's ``weight`` (1 without one) and ``W_g`` the group's total: the
    probabilities of a group's rows sum to exactly its share, and within a group rows keep
    the proportions of their weights. Used as a loader's ``weight``, each group gets its share
    of every epoch's draws in expectation, however many rows it has.

    Parameters
    ----------
    groups
        The column naming each row's group: strings (a source, ``cache_id``), categoricals,
        enums or integers.
    shares
        Group → share, non-negative, scaled to sum to 1 (``{"web": 6, "code": 3}`` is
        ``{"web": 0.6667, "code": 0.3333}``). A group with share 0 is never drawn.
    weight
        Per-sample weights to keep within each group.

    Raises
    ------
    WeightError
        Now: a share is negative, not finite or not a number, or every share is zero.
    polars.exceptions.ComputeError
        When the expression runs, naming the group or row: a row whose group ``shares`` does
        not name, a null group, a named group with a positive share but no rows (or only
        rows of weight zero), or a bad ``weight``.
    """
    if not isinstance(shares, Mapping) or not shares:
        raise ArgumentError(f"shares must be a non-empty mapping of group to share, got {shares!r}")
    names: list[str] = []
    values: list[float] = []
    for group, share in shares.items():
        if isinstance(group, bool) or not isinstance(group, str | int):
            raise ArgumentError(f"groups are named by strings or integers, got {group!r}")
        if isinstance(share, bool) or not isinstance(share, Real):
            raise WeightError(f"the share of group {group!r} must be a number, got {share!r}")
        names.append(str(group))
        values.append(float(share))
    if len(set(names)) < len(names):
        raise ArgumentError(f"shares names a group twice (as a string and an integer): {shares!r}")
    _native.check_shares(names, values)
    args = [_expr(groups)]
    if weight is not None:
        args.append(_expr(weight))
    return register_plugin_function(
        plugin_path=PLUGIN_PATH,
        function_name="mix",
        args=args,
        kwargs={"names": names, "shares": values, "weighted": weight is not None},
        is_elementwise=False,
    )


def split(ids: IntoExpr, fractions: Mapping[str, float], *, seed: int = 0) -> pl.Expr:
    """The name of the split each id falls into, by a stable hash of the id.

    The split of an id depends only on the id, ``seed`` and ``fractions``: not on the other
    rows, their order, the process, the machine or the Polars version. Integer ids are hashed
    as 64-bit integers and string ids by their UTF-8 bytes (xxh3-64); null ids stay null.
    Split by a group id (a patient, a source file) to keep each group in one split.

    Parameters
    ----------
    ids
        Integer or string ids, typically ``sample_id``.
    fractions
        Split name → fraction; fractions are positive and sum to 1.
    seed
        An integer in ``[0, 2**64)``; another seed gives an independent split.
    """
    if not isinstance(fractions, Mapping) or not fractions:
        raise ArgumentError(
            f"fractions must be a non-empty mapping of split name to fraction, got {fractions!r}"
        )
    names = list(fractions)
    values = list(fractions.values())
    for name, value in zip(names, values, strict=True):
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"split names must be non-empty strings, got {name!r}")
        if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
            raise ArgumentError(f"fraction of split {name!r} must be positive, got {value!r}")
    total = math.fsum(float(v) for v in values)
    if abs(total - 1.0) > 1e-9:
        raise ArgumentError(f"split fractions must sum to 1, but {fractions!r} sums to {total}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ArgumentError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return register_plugin_function(
        plugin_path=PLUGIN_PATH,
        function_name="split",
        args=[_expr(ids)],
        # Plugin kwargs decode integers up to 2**63 - 1; the seed's bits travel as an i64.
        kwargs={
            "names": names,
            "fractions": [float(v) for v in values],
            "seed_bits": seed - 2**64 if seed >= 2**63 else seed,
        },
        is_elementwise=True,
    )


def _draw_kwargs(n: int | None, seed: int, epoch: int) -> dict[str, int | None]:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ArgumentError(f"n must be a non-negative integer or None, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ArgumentError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
        raise ArgumentError(f"epoch must be a non-negative integer, got {epoch!r}")
    # Plugin kwargs decode integers up to 2**63 - 1; the seed's bits travel as an i64.
    return {"n": n, "seed_bits": seed - 2**64 if seed >= 2**63 else seed, "epoch": epoch}


def draws(weight: IntoExpr, n: int | None = None, *, seed: int = 0, epoch: int = 0) -> pl.Expr:
    """How many times each row is drawn in an epoch of ``n`` weighted draws.

    These are exactly the draws a shuffling loader over the same rows makes for ``seed``
    and ``epoch`` (summed over all ranks and workers): the same core code computes both.

    Parameters
    ----------
    weight
        The sampling weights.
    n
        Draws in the epoch; by default one per row (the loader's default ``num_samples``).
    seed, epoch
        The loader's ``seed`` and epoch.
    """
    return register_plugin_function(
        plugin_path=PLUGIN_PATH,
        function_name="draws",
        args=[_expr(weight)],
        kwargs=_draw_kwargs(n, seed, epoch),
        is_elementwise=False,
    )


def draw_rows(weight: IntoExpr, n: int | None = None, *, seed: int = 0, epoch: int = 0) -> pl.Expr:
    """The row number drawn at each position of an epoch, in draw order (``n`` rows out)."""
    return register_plugin_function(
        plugin_path=PLUGIN_PATH,
        function_name="draw_rows",
        args=[_expr(weight)],
        kwargs=_draw_kwargs(n, seed, epoch),
        is_elementwise=False,
        changes_length=True,
    )

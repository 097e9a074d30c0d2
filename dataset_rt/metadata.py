"""The metadata table: collecting per-record attributes during a build and checking them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import polars as pl

from dataset_rt import _native
from dataset_rt._version_check import CACHE_ID_DTYPE, POLARS_2
from dataset_rt.errors import MetadataError, WeightError

__all__ = [
    "RESERVED_COLUMNS",
    "MetadataCollector",
    "cache_codes",
    "checked_scan",
    "house_ids",
]

RESERVED_COLUMNS = ("cache_id", "sample_id")
"""Columns dataset_rt fills in itself; ``metadata()`` may not return them."""

_DTYPES: dict[type, pl.DataType] = {
    bool: pl.Boolean(),
    int: pl.Int64(),
    float: pl.Float64(),
    str: pl.String(),
}


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _primitive(value: Any) -> Any:
    """Returns ``value`` as a Python primitive, unwrapping numpy scalars; raises TypeError."""
    if value is None or type(value) in _DTYPES:
        return value
    item = getattr(value, "item", None)
    # numpy scalars (np.int64(3), np.float32(0.5), np.bool_(True), np.str_("a")) are
    # primitives in all but type; 0-d arrays are not accepted.
    if item is not None and getattr(value, "shape", None) == () and hasattr(value, "dtype"):
        unwrapped = item()
        if type(unwrapped) in _DTYPES and not hasattr(value, "__len__"):
            return unwrapped
    raise TypeError(type(value).__name__)


class MetadataCollector:
    """Collects the dicts returned by the user's ``metadata(record)`` into typed columns.

    Every record must return the same keys; each key keeps one type (``None`` allowed
    anywhere). A ``weight`` key, if given, becomes the initial sampling weight.

    Rows are kept as tuples and turned into columns once at the end. A row whose keys come
    in the same order and whose values have the same Python types as the row before takes a
    fast path of a few C-level operations; any other row is checked value by value.
    """

    def __init__(self) -> None:
        self._keys: tuple[str, ...] | None = None
        self._rows: list[tuple[Any, ...]] = []
        self._types: list[type | None] = []
        self._row_types: tuple[type, ...] | None = None

    def _start(self, index: int, values: Mapping[Any, Any]) -> tuple[str, ...]:
        for key in values:
            if not isinstance(key, str):
                raise MetadataError(
                    f"metadata() returned key {key!r} for record {index}; keys must be str"
                )
            if key in RESERVED_COLUMNS:
                raise MetadataError(
                    f"metadata() returned key {key!r} for record {index}; "
                    f"{' and '.join(RESERVED_COLUMNS)} are filled in by dataset_rt"
                )
        self._keys = tuple(values)
        self._types = [None] * len(self._keys)
        return self._keys

    def merge(self, other: MetadataCollector, first: int) -> None:
        """Appends the rows ``other`` collected for the records from index ``first`` on.

        ``other`` is another process's share of a parallel build.
        """
        if other._keys is None:
            return
        if self._keys is None:
            self._keys, self._types = other._keys, list(other._types)
            self._rows.extend(other._rows)
            return
        if other._keys != self._keys:
            raise MetadataError(
                f"metadata() returned different keys for the records from {first} on "
                f"({list(other._keys)}) than for the records before them ({list(self._keys)})"
            )
        for column, (seen, kind) in enumerate(zip(self._types, other._types, strict=True)):
            if seen is not None and kind is not None and kind is not seen:
                raise MetadataError(
                    f"metadata key {self._keys[column]!r} is {kind.__name__} in the records "
                    f"from {first} on but {seen.__name__} in earlier records; a column keeps "
                    "one type"
                )
            self._types[column] = seen or kind
        self._rows.extend(other._rows)

    def add(self, index: int, values: object) -> None:
        """Adds the metadata of record ``index``."""
        if type(values) is dict and tuple(values) == self._keys:
            row = tuple(values.values())
            if tuple(map(type, row)) == self._row_types:
                self._rows.append(row)
                return
        self._add_checked(index, values)

    def _add_checked(self, index: int, values: object) -> None:
        if not isinstance(values, Mapping):
            raise MetadataError(
                f"metadata() must return a dict of primitive values, but returned "
                f"{type(values).__name__} for record {index}"
            )
        keys = self._keys if self._keys is not None else self._start(index, values)
        if len(values) != len(keys) or any(k not in values for k in keys):
            missing = [k for k in keys if k not in values]
            extra = [k for k in values if k not in keys]
            raise MetadataError(
                f"metadata() returned different keys for record {index} than for the "
                f"records before it (missing {missing}, unexpected {extra})"
            )
        row = []
        for column, key in enumerate(keys):
            raw = values[key]
            try:
                value = _primitive(raw)
            except TypeError:
                raise MetadataError(
                    f"metadata key {key!r} of record {index} is {type(raw).__name__}; values "
                    "must be int, float, bool, str or None"
                ) from None
            if value is not None:
                kind = type(value)
                if kind is int and not _INT64_MIN <= value <= _INT64_MAX:
                    raise _out_of_range(key, index, value)
                seen = self._types[column]
                if seen is None:
                    self._types[column] = kind
                elif kind is not seen:
                    raise MetadataError(
                        f"metadata key {key!r} is {kind.__name__} in record {index} but "
                        f"{seen.__name__} in earlier records; a column keeps one type"
                    )
            row.append(value)
        checked = tuple(row)
        self._rows.append(checked)
        # Later rows of exactly these types (no None, no numpy scalars) take the fast path.
        types = tuple(map(type, checked))
        if all(t is not type(None) for t in types) and types == tuple(map(type, values.values())):
            self._row_types = types

    def frame(self, cache_id: str, num_samples: int) -> pl.DataFrame:
        """The metadata table: ``cache_id``, ``sample_id``, the attributes, ``weight``."""
        columns: list[pl.Series] = [
            pl.repeat(cache_id, num_samples, dtype=CACHE_ID_DTYPE, eager=True).alias("cache_id"),
            pl.int_range(num_samples, dtype=pl.Int64, eager=True).alias("sample_id"),
        ]
        weight: pl.Series | None = None
        keys = self._keys or ()
        for column, (key, values) in enumerate(
            zip(keys, zip(*self._rows, strict=True), strict=True)
        ):
            kind = self._types[column]
            dtype = _DTYPES[kind] if kind is not None else pl.Null()
            try:
                series = pl.Series(key, values, dtype=dtype)
            except (OverflowError, TypeError, pl.exceptions.PolarsError) as exc:
                # Only integers beyond 64 bits get past the fast path; name the first one.
                for index, value in enumerate(values):
                    if type(value) is int and not _INT64_MIN <= value <= _INT64_MAX:
                        raise _out_of_range(key, index, value) from exc
                raise MetadataError(f"metadata key {key!r}: {exc}") from exc
            if key == "weight":
                weight = _initial_weight(series)
            else:
                columns.append(series)
        if weight is None:
            weight = pl.repeat(1.0, num_samples, dtype=pl.Float64, eager=True).alias("weight")
        columns.append(weight)
        return pl.DataFrame(columns)


def _out_of_range(key: str, index: int, value: int) -> MetadataError:
    return MetadataError(
        f"metadata key {key!r} of record {index} is {value}, outside the 64-bit integer range"
    )


def _initial_weight(series: pl.Series) -> pl.Series:
    """Checks a ``weight`` returned by ``metadata()`` and casts it to Float64."""
    # While a cache is built, a record's index is its sample_id.
    ids = pl.int_range(series.len(), dtype=pl.Int64, eager=True)
    return check_weights(series, ids, allow_empty=True)


def _first(mask: pl.Series, values: pl.Series) -> object:
    return values.filter(mask).head(1).item()


def _check_link_dtypes(frame: pl.DataFrame) -> None:
    """Refuses a ``cache_id`` that is not strings or a ``sample_id`` that is not integers."""
    schema = frame.schema
    if schema["cache_id"] not in (pl.String, pl.Categorical) and not isinstance(
        schema["cache_id"], pl.Enum
    ):
        raise MetadataError(f"column 'cache_id' must hold strings, not {schema['cache_id']}")
    if not schema["sample_id"].is_integer():
        raise MetadataError(f"column 'sample_id' must hold integers, not {schema['sample_id']}")


def checked_edit(frame: pl.DataFrame, cache_id: str, num_samples: int, name: str) -> pl.DataFrame:
    """Checks an edited metadata table before it is saved as a new version of a cache.

    Rows may have been filtered out and columns added. Returns the table with ``cache_id``
    as :data:`CACHE_ID_DTYPE`, ``sample_id`` as Int64 and ``weight`` as Float64.

    Raises
    ------
    MetadataError
        A required column is missing or of the wrong type, a row belongs to another cache or
        to no sample of this one, or a ``sample_id`` appears twice.
    WeightError
        A weight is null, negative, NaN or infinite, or all weights are zero.
    """
    missing = [c for c in (*RESERVED_COLUMNS, "weight") if c not in frame.columns]
    if missing:
        raise MetadataError(
            f"the metadata table lacks column(s) {missing}; cache_id, sample_id and weight "
            "link each row to its sample and its sampling weight"
        )
    _check_link_dtypes(frame)

    cache_ids = _comparable(frame["cache_id"])
    foreign = cache_ids.ne_missing(cache_id)
    if foreign.any():
        raise MetadataError(
            f"{foreign.sum()} row(s) do not belong to cache {name!r} (cache_id {cache_id}); "
            f"the first has cache_id {_first(foreign, cache_ids)!r}. Filter the frame to "
            "this cache's rows before saving it"
        )
    ids = frame["sample_id"]
    outside = ids.is_null() | (ids < 0) | (ids >= num_samples)
    if outside.any():
        raise MetadataError(
            f"sample_id {_first(outside, ids)} is not a sample of cache {name!r}, which has "
            f"sample ids 0 to {num_samples - 1}"
        )
    # Counting distinct ids is a pass over a sorted column (and a hash otherwise); finding
    # which id repeats costs more, so only a table that has one pays for it.
    duplicated = ids.is_duplicated() if ids.n_unique() != ids.len() else None
    if duplicated is not None:
        raise MetadataError(
            f"sample_id {_first(duplicated, ids)} appears more than once; each sample has one "
            "row (use the weight to sample it more often)"
        )
    # An empty cache has an empty table, and that is all it can have.
    weight = check_weights(frame["weight"], ids, allow_empty=num_samples == 0)
    return frame.with_columns(pl.col("cache_id").cast(CACHE_ID_DTYPE), ids.cast(pl.Int64), weight)


def house_ids(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` (a saved table) with its ``cache_id`` as :data:`CACHE_ID_DTYPE`.

    Tables saved before the column became categorical hold strings; they are read as
    tables saved since are, so that frames of old and new caches still concatenate.
    """
    if frame.schema.get("cache_id") in (None, CACHE_ID_DTYPE):
        return frame
    return frame.with_columns(pl.col("cache_id").cast(CACHE_ID_DTYPE))


def link_columns(frame: pl.DataFrame) -> tuple[pl.Series, pl.Series]:
    """The frame's ``cache_id`` as strings and ``sample_id`` as Int64 (or UInt64).

    Raises
    ------
    MetadataError
        A column is missing, of another dtype (the message names it), or holds a null.
    """
    missing = [c for c in ("cache_id", "sample_id") if c not in frame.columns]
    if missing:
        raise MetadataError(
            f"the frame lacks the column(s) {missing}: cache_id and sample_id link rows to "
            "their records"
        )
    _check_link_dtypes(frame)
    cache_ids, ids = frame["cache_id"], frame["sample_id"]
    for column in (cache_ids, ids):
        if column.null_count():
            raise MetadataError(f"column {column.name!r} holds nulls; every row needs one")
    if ids.dtype not in (pl.Int64, pl.UInt64):
        ids = ids.cast(pl.Int64)  # Int128 ids beyond the Int64 range fail here, by name
    return _comparable(cache_ids), ids


def _comparable(cache_ids: pl.Series) -> pl.Series:
    """``cache_ids`` as strings, or as they are if categorical (with Polars 2).

    A categorical column is compared with a ``str`` and mapped to codes by its category
    codes: at 100M rows, casting it would make a string for every row.
    """
    if POLARS_2 and cache_ids.dtype == pl.Categorical:
        return cache_ids
    return cache_ids.cast(pl.String)


def cache_codes(
    cache_ids: pl.Series, known: list[str] | None = None
) -> tuple[list[str], pl.Series]:
    """Each row's cache as a UInt32 code, and the ids the codes index.

    The code is the row's index in ``known`` (null where ``known`` lacks it), by default
    among the distinct ids in order of first appearance. ``cache_ids`` are as
    :func:`link_columns` gives them.
    """
    if known is None:
        known = cast(list[str], cache_ids.unique(maintain_order=True).to_list())
    codes = cache_ids.replace_strict(
        known, list(range(len(known))), default=None, return_dtype=pl.UInt32
    )
    return known, codes


def check_weights(weight: pl.Series, ids: pl.Series, *, allow_empty: bool = False) -> pl.Series:
    """Checks sampling weights; returns them as Float64. Errors name the sample_id.

    ``allow_empty`` accepts a column without rows (the table of an empty cache).

    Raises
    ------
    WeightError
        The column is not numeric, a weight is null, negative, NaN or infinite, or the
        weights sum to zero or overflow. The rule itself is the engine's
        (``drt_core::weights``), the same that the ``.drt`` expressions apply.
    """
    if not (weight.dtype.is_numeric() or weight.dtype == pl.Null):
        raise WeightError(f"column 'weight' must be numeric, not {weight.dtype}")
    weight = weight.cast(pl.Float64).alias("weight")
    _native.check_weights(pl.DataFrame([weight, ids.alias("sample_id")]), allow_empty)
    return weight


_U32_MAX = 2**32 - 1


def token_lengths(frame: pl.DataFrame) -> pl.Series:
    """The frame's ``length`` column (token documents' ids each), checked, as UInt32.

    Raises
    ------
    MetadataError
        The column is missing or not integers, or a length is null or outside 1 to 2³² - 1.
        Errors name the row.
    """
    if "length" not in frame.columns:
        raise MetadataError(
            "a packed loader (seq_len=) needs the frame's length column, each document's "
            "token count: token caches write it; keep it in the frame"
        )
    column = frame["length"]
    if not column.dtype.is_integer():
        raise MetadataError(f"the frame's length column must be integers, not {column.dtype}")
    bad = column.is_null() | (column < 1) | (column > _U32_MAX)
    if bad.any():
        row = int(bad.arg_max())  # type: ignore[arg-type]
        raise MetadataError(
            f"row {row} of the frame has length {column[row]}: a document holds 1 to "
            f"{_U32_MAX} tokens"
        )
    return column.cast(pl.UInt32)


# Polars 2 runs Python scan sources in every engine; Polars 1.25's streaming engine cannot.
_DEFERRED = POLARS_2


def checked_scan(path: Path, check: Callable[[], object]) -> pl.LazyFrame:
    """A LazyFrame over the Parquet table at ``path`` that calls ``check()`` before reading it.

    ``check`` (which raises if the table is damaged: it hashes the whole file) runs once per
    LazyFrame, when a query first reads the table, so making the scan costs the same for a
    billion rows as for a thousand, and a query that never reads it (a loader mapping the
    version's saved plan) never pays for it. Queries get Polars' own Parquet scan, with the
    projection, the predicate and the row limit pushed into it. Where Polars cannot run a
    Python scan source in its streaming engine (before Polars 2), ``check`` runs at once.
    """
    if not _DEFERRED:
        check()
        scan = pl.scan_parquet(path)
        if pl.read_parquet_schema(path).get("cache_id") not in (None, CACHE_ID_DTYPE):
            scan = scan.with_columns(pl.col("cache_id").cast(CACHE_ID_DTYPE))  # a Polars 2 table
        return scan
    lock, checked = threading.Lock(), list[bool]()

    def source(
        with_columns: list[str] | None,
        predicate: pl.Expr | None,
        n_rows: int | None,
        batch_size: int | None,
    ) -> Iterator[pl.DataFrame]:
        with lock:
            if not checked:
                check()
                checked.append(True)
        frame = pl.scan_parquet(path)
        if recast:  # a table saved with string ids, read as the house's dtype
            frame = frame.with_columns(pl.col("cache_id").cast(CACHE_ID_DTYPE))
        if with_columns is not None:
            frame = frame.select(with_columns)
        if predicate is not None:
            frame = frame.filter(predicate)
        if n_rows is not None:
            frame = frame.head(n_rows)
        # Typed through Any: the type checker may see Polars 1, which lacks these.
        yield from cast(Any, frame).collect_batches(chunk_size=batch_size)

    from polars.io.plugins import register_io_source

    # The footer alone gives the schema; the table's bytes are checked before any is read.
    # It is read now, as a mapping: given a function instead, Polars imports pyarrow (tens
    # of milliseconds of a fresh process's first batch) to ask whether it is a pyarrow schema.
    try:
        schema = pl.Schema(pl.read_parquet_schema(path))
    except Exception:
        check()  # a damaged table is reported as such (CacheCorruptError)
        raise
    recast = schema.get("cache_id") not in (None, CACHE_ID_DTYPE)
    if recast:
        schema["cache_id"] = CACHE_ID_DTYPE
    pure: dict[str, Any] = {"is_pure": True}
    return register_io_source(source, schema=schema, **pure)

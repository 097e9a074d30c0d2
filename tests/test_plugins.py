"""The Rust expression plugins, through the .drt namespace, eager, lazy and streaming."""

from __future__ import annotations

import ctypes
import struct

import polars as pl
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.exceptions import ComputeError

import dataset_rt as drt
from dataset_rt import plugins
from dataset_rt.errors import ArgumentError, WeightError

PLUGIN_FUNCTIONS = [
    "balance",
    "draw_rows",
    "draws",
    "effective_size",
    "mix",
    "normalize",
    "split",
]


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
    # A cache's own weights break the same rule with the same words, naming the sample.
    by_sample = message.replace("row", "sample_id")
    with pytest.raises(WeightError, match=f"weight column 'weight' {by_sample}"):
        drt.cache(
            range(len(values)),
            "bad-weights",
            metadata=lambda i: {"weight": values[i]},
            progress=False,
        )


def test_normalize_rejects_non_numeric_columns() -> None:
    df = pl.DataFrame({"weight": ["heavy"]})
    with pytest.raises(ComputeError, match="weight column 'weight' must be numeric, not str"):
        df.select(pl.col("weight").drt.normalize())


# -- balance --------------------------------------------------------------------------------
def _group_totals(df: pl.DataFrame, by: list[str], weight: str) -> list[float]:
    totals = df.group_by(by).agg(pl.col(weight).sum())[weight].to_list()
    return sorted(totals)


def test_balance_exact_values_and_power() -> None:
    df = pl.DataFrame({"label": ["a", "a", "a", "b"]})
    equal = df.select(pl.col("label").drt.balance())["label"].to_list()
    assert equal == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0])
    natural = df.select(pl.col("label").drt.balance(power=0.0))["label"].to_list()
    assert natural == [1.0, 1.0, 1.0, 1.0]
    half = df.select(pl.col("label").drt.balance(power=0.5))["label"].to_list()
    # Group totals proportional to sqrt(3) : 1, rescaled to sum to 4.
    scale = 4 / (3**0.5 + 1)
    assert half == pytest.approx([scale / 3**0.5] * 3 + [scale])


def test_balance_several_columns_struct_and_nulls() -> None:
    df = pl.DataFrame(
        {"label": ["a", "a", "b", None, None], "src": [1, 2, 1, 1, 1]},
        schema={"label": pl.String, "src": pl.Int64},
    )
    by_exprs = df.with_columns(w=pl.col("label").drt.balance("src"))
    by_struct = df.with_columns(w=pl.struct("label", "src").drt.balance())
    assert by_exprs["w"].to_list() == by_struct["w"].to_list()
    # Four groups (a,1) (a,2) (b,1) (null,1): each totals 5/4.
    assert _group_totals(by_exprs, ["label", "src"], "w") == pytest.approx([1.25] * 4)
    nulls = df.with_columns(w=pl.col("label").drt.balance())
    assert nulls["w"].to_list()[3:] == pytest.approx([5 / 6, 5 / 6])


def test_balance_on_every_key_dtype_a_label_column_has() -> None:
    codes = [0, 0, 0, 1, 2, 2, None]
    df = pl.DataFrame({"code": codes}, schema={"code": pl.Int64})
    reference = df.select(pl.col("code").drt.balance())["code"].to_list()
    names = pl.col("code").replace_strict({0: "cat", 1: "dog", 2: "eel"}, default=None)
    keys = {
        "uint8": pl.col("code").cast(pl.UInt8),
        "int16": pl.col("code").cast(pl.Int16),
        "uint16": pl.col("code").cast(pl.UInt16),
        "float32": pl.col("code").cast(pl.Float32),
        "string": names,
        "categorical": names.cast(pl.Categorical),
        "enum": names.cast(pl.Enum(["cat", "dog", "eel"])),
        "date": pl.col("code").cast(pl.Date),
        "datetime": pl.col("code").cast(pl.Datetime("us")),
        "duration": pl.col("code").cast(pl.Duration("ms")),
        "decimal": pl.col("code").cast(pl.Decimal(12, 2)),
        "array": pl.concat_arr(pl.col("code"), pl.col("code")),
        "struct": pl.struct(a=names.cast(pl.Categorical), b=pl.col("code").cast(pl.UInt8)),
    }
    for name, key in keys.items():
        got = df.select(key.alias(name)).select(pl.col(name).drt.balance())[name].to_list()
        assert got == pytest.approx(reference), name
    lazy = df.lazy().select(w=names.cast(pl.Categorical).drt.balance()).collect(engine="streaming")
    assert lazy["w"].to_list() == pytest.approx(reference)


def test_dtypes_the_plugins_refuse_are_errors_not_crashes() -> None:
    df = pl.DataFrame({"w": [1.0, 2.0], "id": ["a", "b"]})
    decimal = df.select(w=pl.col("w").cast(pl.Decimal(10, 2)).drt.balance())
    assert decimal["w"].to_list() == pytest.approx([1.0, 1.0])
    with pytest.raises(pl.exceptions.ComputeError, match="must be integers or strings"):
        df.select(pl.col("id").cast(pl.Categorical).drt.split({"a": 0.5, "b": 0.5}))
    with pytest.raises(pl.exceptions.ComputeError, match="must be numeric"):
        df.select(pl.col("id").cast(pl.Categorical).drt.normalize())
    # The process is still fine afterwards.
    assert df.select(pl.col("w").drt.normalize())["w"].to_list() == pytest.approx([1 / 3, 2 / 3])


def test_balance_keeps_shares_of_existing_weights() -> None:
    df = pl.DataFrame({"label": ["a", "a", "b"], "weight": [1.0, 3.0, 1.0]})
    out = df.with_columns(w=pl.col("label").drt.balance(weight="weight"))["w"].to_list()
    assert out[1] / out[0] == pytest.approx(3.0)
    assert out[0] + out[1] == pytest.approx(out[2])
    assert sum(out) == pytest.approx(5.0)


def test_balance_in_lazy_streaming_over_and_agg() -> None:
    df = pl.DataFrame({"label": [0, 0, 1, 1, 1, 2], "site": ["x", "y", "x", "x", "y", "y"]})
    eager = df.with_columns(w=pl.col("label").drt.balance())
    lazy = df.lazy().with_columns(w=pl.col("label").drt.balance()).collect(engine="streaming")
    assert lazy["w"].to_list() == eager["w"].to_list()
    # Within each site separately: labels balanced per site.
    per_site = df.with_columns(w=pl.col("label").drt.balance().over("site"))
    for site in ("x", "y"):
        part = per_site.filter(pl.col("site") == site)
        totals = _group_totals(part, ["label"], "w")
        assert totals == pytest.approx([totals[0]] * len(totals))
    agg = df.group_by("site", maintain_order=True).agg(pl.col("label").drt.balance())
    assert [len(v) for v in agg["label"].to_list()] == [3, 3]
    kept = df.filter(pl.col("label").drt.balance() > 1.0)
    assert kept["label"].to_list() == [2]


def test_balance_rejects_bad_arguments() -> None:
    with pytest.raises(drt.errors.ArgumentError, match="power must be"):
        pl.col("label").drt.balance(power=2.0)
    with pytest.raises(drt.errors.ArgumentError, match="power must be"):
        pl.col("label").drt.balance(power="1")  # type: ignore[arg-type]
    df = pl.DataFrame({"label": [1, 2], "weight": [1.0, -1.0]})
    with pytest.raises(ComputeError, match="holds -1 at row 1"):
        df.select(pl.col("label").drt.balance(weight="weight"))


# -- split ----------------------------------------------------------------------------------
def _reference_split(ids: list[int], fractions: dict[str, float], seed: int) -> list[str]:
    """The documented rule, computed with an independent xxh3 implementation."""
    names, bounds, total = list(fractions), [], 0.0
    for f in fractions.values():
        total += f
        bounds.append(total)
    out = []
    for i in ids:
        h = xxhash.xxh3_64_intdigest(struct.pack("<q", i), seed=seed)
        u = (h >> 11) * 2.0**-53
        out.append(next((n for n, b in zip(names, bounds, strict=True) if u < b), names[-1]))
    return out


def test_split_follows_the_documented_hash_rule() -> None:
    ids = [*range(-5, 2000), 2**62, -(2**63)]
    fractions = {"train": 0.7, "val": 0.2, "test": 0.1}
    for seed in (0, 7, 2**64 - 1):
        got = pl.DataFrame({"sample_id": ids}).select(
            pl.col("sample_id").drt.split(fractions, seed=seed)
        )["sample_id"]
        assert got.to_list() == _reference_split(ids, fractions, seed)
    words = ["", "a", "patient-17", "ünïcode"]
    got = pl.DataFrame({"w": words}).select(pl.col("w").drt.split({"x": 0.5, "y": 0.5}))["w"]
    expected = [
        "x" if (xxhash.xxh3_64_intdigest(w.encode(), seed=0) >> 11) * 2.0**-53 < 0.5 else "y"
        for w in words
    ]
    assert got.to_list() == expected


def test_split_fractions_within_sampling_error_on_a_million_ids() -> None:
    n = 1_000_000
    fractions = {"train": 0.8, "val": 0.15, "test": 0.05}
    ids = pl.DataFrame({"sample_id": pl.int_range(n, eager=True)})
    counts = dict(
        ids.select(pl.col("sample_id").drt.split(fractions, seed=3))["sample_id"]
        .value_counts()
        .iter_rows()
    )
    for name, f in fractions.items():
        sigma = (n * f * (1 - f)) ** 0.5
        assert abs(counts[name] - n * f) < 5 * sigma, (name, counts)


def test_split_of_an_id_ignores_the_other_rows_and_their_order() -> None:
    full = pl.DataFrame({"sample_id": range(1000)}).with_columns(
        part=pl.col("sample_id").drt.split({"a": 0.3, "b": 0.7})
    )
    subset = (
        full.select("sample_id")
        .sample(fraction=0.2, seed=1, shuffle=True)
        .with_columns(part=pl.col("sample_id").drt.split({"a": 0.3, "b": 0.7}))
    )
    joined = subset.join(full, on="sample_id", suffix="_full")
    assert joined["part"].to_list() == joined["part_full"].to_list()
    streamed = (
        full.lazy()
        .select("sample_id", part=pl.col("sample_id").drt.split({"a": 0.3, "b": 0.7}))
        .collect(engine="streaming")
    )
    assert streamed["part"].to_list() == full["part"].to_list()


def test_split_by_string_group_and_integer_types() -> None:
    df = pl.DataFrame({"patient": ["p1", "p1", "p2", "p3", "p2", None]})
    parts = df.with_columns(part=pl.col("patient").drt.split({"train": 0.5, "val": 0.5}))
    by_patient = parts.drop_nulls("patient").group_by("patient").agg(pl.col("part").n_unique())
    assert by_patient["part"].to_list() == [1, 1, 1]
    assert parts["part"][5] is None
    ints = pl.DataFrame({"i": [1, 2, 3]})
    a = ints.select(pl.col("i").drt.split({"x": 0.5, "y": 0.5}))["i"].to_list()
    b = ints.select(pl.col("i").cast(pl.UInt16).drt.split({"x": 0.5, "y": 0.5}))["i"].to_list()
    assert a == b
    with pytest.raises(ComputeError, match="must be integers or strings"):
        pl.DataFrame({"f": [1.5]}).select(pl.col("f").drt.split({"x": 1.0}))


@pytest.mark.parametrize(
    ("fractions", "seed", "message"),
    [
        ({"train": 0.9, "val": 0.2}, 0, "sum to 1"),
        ({"train": 1.0, "val": 0.0}, 0, "must be positive"),
        ({}, 0, "non-empty mapping"),
        ({"": 1.0}, 0, "non-empty strings"),
        ({"train": 1.0}, -1, "seed must be"),
        ({"train": 1.0}, 2**64, "seed must be"),
    ],
)
def test_split_validates_fractions_and_seed(
    fractions: dict[str, float], seed: int, message: str
) -> None:
    with pytest.raises(drt.errors.ArgumentError, match=message):
        pl.col("sample_id").drt.split(fractions, seed=seed)


# -- effective_size -------------------------------------------------------------------------
def test_effective_size_values_and_aggregation() -> None:
    df = pl.DataFrame({"g": ["a", "a", "b", "b"], "w": [1.0, 1.0, 1.0, 0.0]})
    assert df.select(pl.col("w").drt.effective_size()).item() == pytest.approx(3.0)
    per = df.group_by("g", maintain_order=True).agg(ess=pl.col("w").drt.effective_size())
    assert per["ess"].to_list() == pytest.approx([2.0, 1.0])
    lazy = df.lazy().select(pl.col("w").drt.effective_size()).collect(engine="streaming")
    assert lazy.item() == pytest.approx(3.0)
    with pytest.raises(ComputeError, match="sums to zero"):
        pl.DataFrame({"w": [0.0]}).select(pl.col("w").drt.effective_size())


# -- properties -----------------------------------------------------------------------------
@given(
    labels=st.lists(st.one_of(st.none(), st.integers(0, 6)), min_size=1, max_size=300),
    power=st.floats(0.0, 1.0),
)
@settings(max_examples=60, deadline=None)
def test_property_balance(labels: list[int | None], power: float) -> None:
    df = pl.DataFrame({"label": labels}, schema={"label": pl.Int64})
    out = df.with_columns(w=pl.col("label").drt.balance(power=power))
    assert out["w"].sum() == pytest.approx(len(labels))
    counts = out.group_by("label").agg(n=pl.len(), total=pl.col("w").sum())
    # Group totals are proportional to size^(1 - power).
    ratio = counts["total"] / counts["n"].cast(pl.Float64) ** (1 - power)
    assert ratio.max() == pytest.approx(ratio.min(), rel=1e-9)


@given(ids=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50, unique=True))
@settings(max_examples=40, deadline=None)
def test_property_split_is_per_id(ids: list[int]) -> None:
    fractions = {"a": 0.25, "b": 0.75}
    whole = pl.DataFrame({"id": ids}).select(pl.col("id").drt.split(fractions))["id"].to_list()
    one_by_one = [
        pl.DataFrame({"id": [i]}).select(pl.col("id").drt.split(fractions))["id"][0] for i in ids
    ]
    assert whole == one_by_one


def test_mix_gives_each_group_exactly_its_share_and_keeps_weights_within() -> None:
    df = pl.DataFrame(
        {
            "source": ["web"] * 6 + ["code"] * 3 + ["books"],
            "w": [1.0, 1.0, 2.0, 0.0, 1.0, 5.0, 1.0, 1.0, 1.0, 7.0],
        }
    )
    shares = {"web": 0.6, "code": 0.3, "books": 0.1}
    lazy = df.lazy().with_columns(p=pl.col("source").drt.mix(shares, weight="w"))
    for mixed in (lazy.collect(), lazy.collect(engine="streaming")):
        totals = dict(mixed.group_by("source").agg(pl.col("p").sum()).rows())
        assert totals == pytest.approx(shares, abs=1e-12)
        web = mixed.filter(pl.col("source") == "web")["p"].to_list()
        assert web == pytest.approx([0.06, 0.06, 0.12, 0.0, 0.06, 0.3])
    # Shares are scaled to sum to 1; without weights a group's rows share equally; a group
    # with share 0 is never drawn; integer labels and categoricals name groups too.
    equal = df.select(pl.col("source").drt.mix({"web": 2, "code": 2, "books": 0}))["source"]
    assert equal.to_list() == pytest.approx([0.5 / 6] * 6 + [0.5 / 3] * 3 + [0.0])
    codes = pl.DataFrame({"g": [1, 1, 2]}).select(pl.col("g").drt.mix({1: 1, 2: 3}))["g"]
    assert codes.to_list() == [0.125, 0.125, 0.75]
    cats = df.with_columns(pl.col("source").cast(pl.Categorical))
    assert cats.select(pl.col("source").drt.mix(shares))["source"].sum() == pytest.approx(1.0)


def test_a_mixed_loader_draws_each_source_its_share() -> None:
    web = drt.cache((("web", i) for i in range(900)), "mix-web", progress=False)
    code = drt.cache((("code", i) for i in range(100)), "mix-code", progress=False)
    frame = pl.concat([web.metadata, code.metadata]).with_columns(
        weight=pl.col("cache_id").drt.mix({web.cache_id: 0.25, code.cache_id: 0.75})
    )
    loader = frame.drt.loader(batch_size=500, seed=3, num_samples=20_000, collate=list)
    drawn = sum(1 for batch in loader for source, _ in batch if source == "code")
    previewed = frame.with_columns(n=pl.col("weight").drt.draws(20_000, seed=3))
    assert drawn == previewed.filter(pl.col("cache_id") == code.cache_id)["n"].sum()
    assert 0.73 < drawn / 20_000 < 0.77, "a tenth of the rows gets three quarters of the draws"


def test_mix_refuses_what_cannot_be_drawn() -> None:
    df = pl.DataFrame({"source": ["web", "web", "code"], "w": [1.0, 0.0, 1.0]})
    with pytest.raises(WeightError, match="share of group 'code' is -1"):
        pl.col("source").drt.mix({"web": 1, "code": -1})
    with pytest.raises(WeightError, match="every share is zero"):
        pl.col("source").drt.mix({"web": 0, "code": 0.0})
    with pytest.raises(WeightError, match="must be a number"):
        pl.col("source").drt.mix({"web": "half"})  # type: ignore[dict-item]
    with pytest.raises(ArgumentError, match="non-empty mapping"):
        pl.col("source").drt.mix({})
    with pytest.raises(ComputeError, match="group 'code' of column 'source'.*does not name"):
        df.select(pl.col("source").drt.mix({"web": 1}))
    with pytest.raises(
        ComputeError, match="group 'books' of column 'source' has a share of 0.5 but no rows"
    ):
        df.select(pl.col("source").drt.mix({"web": 1, "code": 1, "books": 0.5}))
    with pytest.raises(
        ComputeError, match="rows of group 'code' of column 'source' all weigh zero"
    ):
        df.select(pl.col("source").drt.mix({"web": 1, "code": 1}, weight=pl.Series([1, 1, 0])))
    with pytest.raises(ComputeError, match="'source' is null at row 1"):
        pl.DataFrame({"source": ["web", None]}).select(pl.col("source").drt.mix({"web": 1}))
    with pytest.raises(ComputeError, match="mix group column 'w' must be strings or integers"):
        df.select(pl.col("w").drt.mix({"1.0": 1}))

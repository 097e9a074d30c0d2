"""Versioned metadata edits: save_metadata, metadata_versions, metadata_at, and rejections."""

from __future__ import annotations

import hashlib
from pathlib import Path

import polars as pl
import pytest
from helpers import python_child, record, same_record

import dataset_rt as drt
from dataset_rt.errors import MetadataError, StaleCacheError, WeightError


@pytest.fixture
def digits() -> drt.Cache:
    return drt.cache(
        [record(i) for i in range(100)],
        "meta-cache",
        metadata=lambda r: {"label": r["label"], "caption": r["caption"]},
        shard_size=8192,
        progress=False,
    )


def _shard_digests(cache: drt.Cache) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((cache.path / "shards").iterdir())
    }


def test_save_filters_adds_columns_and_reweights_without_touching_shards(
    digits: drt.Cache,
) -> None:
    before = _shard_digests(digits)
    index_before = (digits.path / "index.arrow").read_bytes()
    losses = pl.DataFrame({"sample_id": range(100), "loss": [i / 100 for i in range(100)]})
    edited = (
        digits.metadata.filter(pl.col("label") != 4)
        .join(losses, on="sample_id")
        .with_columns(weight=pl.col("label").drt.balance() * (1 + pl.col("loss")))
    )
    version = digits.save_metadata(edited)
    assert version == 2
    assert digits.metadata_version == 2
    live = drt.open("meta-cache").metadata
    assert live.height == 80
    assert "loss" in live.columns
    assert live.schema["weight"] == pl.Float64
    assert live["weight"].to_list() == pytest.approx(edited["weight"].to_list())
    assert _shard_digests(digits) == before
    assert (digits.path / "index.arrow").read_bytes() == index_before
    # Payloads are unchanged and still read back.
    assert same_record(drt.open("meta-cache").get(4), record(4))


def test_versions_stay_readable(digits: drt.Cache) -> None:
    original = digits.metadata
    digits.save_metadata(original.with_columns(weight=pl.lit(2.0)))
    digits.save_metadata(original.filter(pl.col("label") == 0).lazy())
    versions = digits.metadata_versions()
    assert versions["version"].to_list() == [1, 2, 3]
    assert versions["rows"].to_list() == [100, 100, 20]
    assert versions["live"].to_list() == [False, False, True]
    assert versions["columns"][0].to_list() == [
        "cache_id",
        "sample_id",
        "label",
        "caption",
        "weight",
    ]
    assert digits.metadata_at(1).equals(original)
    assert digits.metadata_at(2)["weight"].unique().to_list() == [2.0]
    assert digits.metadata.height == 20
    with pytest.raises(MetadataError, match="no metadata version 9"):
        digits.metadata_at(9)
    # Another process sees the newest version too.
    child = python_child(
        f"""
        import dataset_rt as drt
        print(drt.open("meta-cache", root={str(digits.root)!r}).metadata.height)
        """
    )
    out, err = child.communicate(timeout=60)
    assert out.strip() == "20", err


def test_scan_follows_the_live_version(digits: drt.Cache) -> None:
    digits.save_metadata(digits.metadata.head(10))
    assert digits.scan().select(pl.len()).collect().item() == 10


def test_queries_over_a_scan_match_the_table(digits: drt.Cache, tmp_path: Path) -> None:
    table, scan = digits.metadata, digits.scan()
    assert scan.collect_schema() == table.schema
    threes = pl.col("label") == 3
    picked = scan.filter(threes).select("sample_id", "caption")
    assert picked.collect().equals(table.filter(threes).select("sample_id", "caption"))
    assert picked.collect(engine="streaming").equals(picked.collect())
    assert scan.head(7).collect().equals(table.head(7))
    counts = scan.group_by("label").len().sort("label").collect()
    assert counts.equals(table.group_by("label").len().sort("label"))
    joined = scan.join(scan.select("sample_id", w2=pl.col("weight") * 2), on="sample_id")
    assert joined.collect()["w2"].sum() == 2 * table["weight"].sum()
    scan.sink_parquet(tmp_path / "copy.parquet")
    assert pl.read_parquet(tmp_path / "copy.parquet").equals(table)
    # Two caches' scans concatenate, as their tables do.
    other = drt.cache([record(i) for i in range(5)], "other-cache", progress=False)
    both = pl.concat([scan.select("cache_id", "sample_id"), other.scan().select(*_IDS)])
    assert both.collect().height == 105


_IDS = ("cache_id", "sample_id")


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda df: df.drop("weight"), MetadataError, r"lacks column\(s\) \['weight'\]"),
        (lambda df: df.drop("cache_id"), MetadataError, r"lacks column\(s\) \['cache_id'\]"),
        (
            lambda df: df.with_columns(weight=pl.lit("heavy")),
            WeightError,
            "'weight' must be numeric, not String",
        ),
        (
            lambda df: df.with_columns(sample_id=pl.col("sample_id").cast(pl.String)),
            MetadataError,
            "'sample_id' must hold integers",
        ),
        (
            lambda df: df.with_columns(
                cache_id=pl.when(pl.col("sample_id") == 7)
                .then(pl.lit("0123456789ab"))
                .otherwise(pl.col("cache_id"))
            ),
            MetadataError,
            r"1 row\(s\) do not belong to cache 'meta-cache'.*'0123456789ab'",
        ),
        (
            lambda df: df.with_columns(sample_id=pl.col("sample_id") + 1),
            MetadataError,
            "sample_id 100 is not a sample of cache 'meta-cache'",
        ),
        (
            lambda df: pl.concat([df, df.head(1)]),
            MetadataError,
            "sample_id 0 appears more than once",
        ),
        (
            lambda df: df.with_columns(
                weight=pl.when(pl.col("sample_id") == 3).then(-1.0).otherwise(1.0)
            ),
            WeightError,
            "holds -1 at sample_id 3",
        ),
        (
            lambda df: df.with_columns(
                weight=pl.when(pl.col("sample_id") == 5).then(float("nan")).otherwise(1.0)
            ),
            WeightError,
            "holds NaN at sample_id 5",
        ),
        (
            lambda df: df.with_columns(weight=pl.lit(None, dtype=pl.Float64)),
            WeightError,
            "is null at sample_id 0",
        ),
        (lambda df: df.with_columns(weight=pl.lit(0.0)), WeightError, "sums to zero"),
        (lambda df: df.head(0), WeightError, "sums to zero"),
    ],
)
def test_rejected_edits_write_nothing(digits: drt.Cache, edit, error, message) -> None:  # type: ignore[no-untyped-def]
    files_before = sorted(p.name for p in (digits.path / "metadata").iterdir())
    with pytest.raises(error, match=message):
        digits.save_metadata(edit(digits.metadata))
    assert sorted(p.name for p in (digits.path / "metadata").iterdir()) == files_before
    assert digits.metadata_version == 1


def test_rows_of_another_cache_are_rejected_and_concat_keeps_links(digits: drt.Cache) -> None:
    other = drt.cache([{"x": i} for i in range(5)], "other", progress=False)
    both = pl.concat([digits.metadata.select("cache_id", "sample_id", "weight"), other.metadata])
    with pytest.raises(MetadataError, match="do not belong to cache 'meta-cache'"):
        digits.save_metadata(both)
    picked = both.filter(pl.col("sample_id").is_in([2, 3]))
    records = picked.drt.records(n=4)
    assert same_record(records[0], record(2))
    assert same_record(records[1], record(3))
    assert records[2:] == [{"x": 2}, {"x": 3}]


def test_save_on_a_rebuilt_cache_is_refused(digits: drt.Cache) -> None:
    old_frame = digits.metadata
    drt.cache([1, 2, 3], "meta-cache", overwrite=True, progress=False)
    with pytest.raises(StaleCacheError):
        digits.save_metadata(old_frame)


def test_concurrent_saves_all_land(digits: drt.Cache, tmp_path: Path) -> None:
    code = f"""
    import polars as pl, dataset_rt as drt
    c = drt.open("meta-cache", root={str(digits.root)!r})
    for k in range(5):
        c.save_metadata(c.metadata_at(1).with_columns(weight=pl.lit(float(k + 1))))
    print("ok")
    """
    children = [python_child(code) for _ in range(3)]
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    versions = digits.metadata_versions()
    assert versions["version"].to_list() == list(range(1, 17))
    for v in range(2, 17):
        assert digits.metadata_at(v).height == 100


def test_records_of_a_filtered_frame(digits: drt.Cache) -> None:
    threes = digits.metadata.filter(pl.col("label") == 3)
    records = threes.drt.records(n=3)
    assert [r["label"] for r in records] == [3, 3, 3]
    assert same_record(records[0], record(3))
    assert threes.lazy().drt.records(n=1)[0]["caption"] == "sample 3"
    assert digits.metadata.drt.records(n=0) == []


def test_records_find_caches_by_id_under_a_root(digits: drt.Cache) -> None:
    frame = digits.metadata.head(2)
    child = python_child(
        f"""
        import polars as pl, dataset_rt as drt
        frame = pl.read_parquet({str(digits.path / "metadata" / "v00001.parquet")!r}).head(2)
        print([r["caption"] for r in frame.drt.records(root={str(digits.root)!r})])
        try:
            frame.with_columns(cache_id=pl.lit("ffffffffffff")).drt.records()
        except drt.errors.CacheNotFoundError as e:
            print("missing:", "no cache with cache_id" in str(e))
        """,
        env={"DATASET_RT_HOME": "/nonexistent-home"},
    )
    out, err = child.communicate(timeout=60)
    assert "['sample 0', 'sample 1']" in out, err
    assert "missing: True" in out, err
    assert frame.height == 2

"""Opening and reading caches: get, metadata, listing, display, and damaged files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import polars as pl
import pytest
from helpers import record, same_record

import dataset_rt as drt
from dataset_rt._version_check import POLARS_2
from dataset_rt.errors import (
    CacheCorruptError,
    CacheNotFoundError,
    CacheVersionError,
    SampleIndexError,
    SerializationError,
    StaleCacheError,
)


def test_get_reads_every_record_back_across_shards(small: drt.Cache) -> None:
    assert small.num_shards > 5
    reopened = drt.open("small")
    assert len(reopened) == 200
    for i in range(200):
        assert same_record(reopened.get(i), record(i))
        assert same_record(reopened.get(i, verify=True), record(i))


def test_out_of_range_and_non_int_ids(small: drt.Cache) -> None:
    with pytest.raises(SampleIndexError, match="sample_id 200 is out of range.*200 samples"):
        small.get(200)
    with pytest.raises(SampleIndexError, match="negative"):
        small.get_bytes(-1)
    with pytest.raises(TypeError, match="sample_id must be an int"):
        small.get("3")  # type: ignore[arg-type]
    import numpy as np

    assert small.get(np.int64(3))["label"] == 3  # type: ignore[arg-type]


def test_get_many_returns_records_in_the_order_asked_for(small: drt.Cache) -> None:
    import numpy as np

    ids = [199, 0, 57, 57, 3]
    for asked in (ids, tuple(ids), np.array(ids), range(5)):
        expected = [record(i) for i in (asked if not isinstance(asked, np.ndarray) else ids)]
        got = small.get_many(asked, verify=True)
        assert len(got) == len(expected)
        assert all(same_record(g, e) for g, e in zip(got, expected, strict=True))
    assert small.get_many([]) == []
    with pytest.raises(SampleIndexError, match="sample_id 200 is out of range"):
        small.get_many([1, 200])
    with pytest.raises(SampleIndexError, match="negative"):
        small.get_many([1, -2])
    raw = small.get_many([7, 2, 7], decode=bytes)
    assert raw == [small.get_bytes(7), small.get_bytes(2), small.get_bytes(7)]
    # A decoder that takes bytes reads all ids in one call, with the same errors.
    assert small.get_many([], decode=bytes) == []
    with pytest.raises(SampleIndexError, match="sample_id 200 is out of range"):
        small.get_many([1, 200], decode=bytes)
    with pytest.raises(SampleIndexError, match="negative"):
        small.get_many([1, -2], decode=bytes)
    with pytest.raises(TypeError, match="sample_id must be an int, not str"):
        small.get_many([1, "2"], decode=bytes)  # type: ignore[list-item]


def test_a_map_style_dataset_serves_dataloader_batches_with_get_many(small: drt.Cache) -> None:
    import torch

    class Records(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self, cache: drt.Cache) -> None:
            self.cache, self.batched = cache, 0

        def __len__(self) -> int:
            return len(self.cache)

        def __getitem__(self, i: int) -> object:
            raise AssertionError("DataLoader asks __getitems__ for whole batches")

        def __getitems__(self, ids: list[int]) -> list[object]:
            self.batched += 1
            return self.cache.get_many(ids)

    dataset = Records(small)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, collate_fn=list)
    seen = [r["label"] for batch in loader for r in batch]
    assert seen == [record(i)["label"] for i in range(200)]
    assert dataset.batched == 7


def test_repr_and_html(small: drt.Cache) -> None:
    text = repr(small)
    assert text.startswith("Cache('small', samples=200,")
    assert small.cache_id in text
    page = small._repr_html_()
    assert "<table>" in page and "label: Int64" in page and small.cache_id in page


def test_list_caches(small: drt.Cache) -> None:
    drt.cache(range(3), "another", progress=False)
    table = drt.list_caches()
    assert table["name"].to_list() == ["another", "small"]
    row = table.filter(pl.col("name") == "small").row(0, named=True)
    assert row["cache_id"] == small.cache_id
    assert row["samples"] == 200
    assert row["bytes"] == small.nbytes
    assert table.schema["created"] == pl.Datetime("us", "UTC")
    assert drt.list_caches(small.root / "nowhere").height == 0


def test_opening_reads_no_payload_bytes(tmp_path: Path) -> None:
    big = [os.urandom(64 << 10) for _ in range(256)]  # 16 MiB of payload
    c = drt.cache(big, "big", progress=False)
    io_path = Path("/proc/self/io")
    if not io_path.exists():
        pytest.skip("needs /proc/self/io")

    def rchar() -> int:
        return int(io_path.read_text().split("rchar:")[1].split()[0])

    before = rchar()
    opened = drt.open("big")
    read = rchar() - before
    assert len(opened) == 256
    # The manifest is read with read(2); the index and shards are mapped, not read.
    assert read < 64 << 10, f"open read {read} bytes"
    assert opened.get(255) == big[255]
    assert c.cache_id == opened.cache_id


def test_payloads_are_not_checked_at_open_but_verify_catches_damage(small: drt.Cache) -> None:
    shard = small.path / "shards" / "00000.bin"
    data = bytearray(shard.read_bytes())
    data[100:] = bytes(len(data) - 100)  # zero every record in the first shard
    shard.write_bytes(bytes(data))
    damaged = drt.open("small")  # same sizes: opens without reading payloads
    with pytest.raises(CacheCorruptError, match=r"00000.bin: sample_id 0 fails its checksum"):
        damaged.get(0, verify=True)
    with pytest.raises(SerializationError, match="decoding sample_id 0"):
        damaged.get(0)


def test_missing_cache_names_name_and_root() -> None:
    with pytest.raises(CacheNotFoundError, match="no cache 'absent' under"):
        drt.open("absent")


def _manifest(c: drt.Cache) -> tuple[Path, dict[str, object]]:
    path = c.path / "manifest.json"
    return path, json.loads(path.read_text())


def test_newer_format_version(small: drt.Cache) -> None:
    path, manifest = _manifest(small)
    manifest["format_version"] = 99
    path.write_text(json.dumps(manifest))
    with pytest.raises(CacheVersionError, match="format version 99"):
        drt.open("small")
    with pytest.raises(CacheVersionError, match="overwrite=True"):
        drt.cache([1], "small", progress=False)
    assert len(drt.cache([1], "small", overwrite=True, progress=False)) == 1


@pytest.mark.parametrize(
    ("serializer", "stored_in_format_1"), [("pickle", "pickle-oob"), ("pickle-inband", "pickle")]
)
def test_a_format_1_cache_opens_with_the_serializer_it_was_built_with(
    serializer: str, stored_in_format_1: str
) -> None:
    import numpy as np

    array = np.arange(1 << 15, dtype=np.float64)  # 256 KiB: out of band under "pickle"
    built = drt.cache([{"x": array}], "old", serializer=serializer, progress=False)  # type: ignore[arg-type]
    path, manifest = _manifest(built)
    manifest["format_version"], manifest["serializer"] = 1, stored_in_format_1
    path.write_text(json.dumps(manifest))
    cache = drt.open("old")
    assert cache.serializer == serializer
    record = cache.get(0)
    assert np.array_equal(record["x"], array)
    # Out-of-band arrays come back as read-only views; in-band ones as private copies.
    assert record["x"].flags.writeable == (serializer == "pickle-inband")
    # Rewrites the manifest in the oldest format that holds it: 3 for an uncompressed cache
    # (4 adds compression), readable by every release since parts came in.
    cache.save_metadata(cache.metadata)
    assert json.loads(path.read_text())["format_version"] == 3 < drt._native.FORMAT_VERSION
    assert json.loads(path.read_text())["serializer"] == serializer
    assert drt.open("old").serializer == serializer


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate-shard", r"shards/00002.bin: file is \d+ bytes but the manifest records"),
        ("delete-shard", r"shards/00001.bin: file is missing"),
        ("truncate-index", r"index.arrow: file is \d+ bytes"),
        ("garble-index", r"index.arrow"),
        ("garble-manifest", r"manifest.json: not valid JSON"),
        ("manifest-escape", r"leaves the cache directory"),
        ("bad-shard-header", r"00000.bin: not a dataset_rt shard"),
    ],
)
def test_damaged_files_raise_naming_the_file(small: drt.Cache, damage: str, message: str) -> None:
    path = small.path
    if damage == "truncate-shard":
        shard = path / "shards" / "00002.bin"
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "delete-shard":
        (path / "shards" / "00001.bin").unlink()
    elif damage == "truncate-index":
        index = path / "index.arrow"
        index.write_bytes(index.read_bytes()[:100])
    elif damage == "garble-index":
        index = path / "index.arrow"
        index.write_bytes(bytes(len(index.read_bytes())))
    elif damage == "garble-manifest":
        (path / "manifest.json").write_text("{not json")
    elif damage == "manifest-escape":
        manifest_path, manifest = _manifest(small)
        manifest["index"]["file"] = "../../etc/passwd"  # type: ignore[index]
        manifest_path.write_text(json.dumps(manifest))
    elif damage == "bad-shard-header":
        shard = path / "shards" / "00000.bin"
        data = bytearray(shard.read_bytes())
        data[:8] = b"NOTSHARD"
        shard.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match=message):
        drt.open("small")


def test_metadata_file_damage_is_a_clear_error(small: drt.Cache) -> None:
    (small.path / "metadata" / "v00001.parquet").write_bytes(b"garbage")
    with pytest.raises(CacheCorruptError, match="v00001.parquet: metadata table fails"):
        _ = drt.open("small").metadata


def test_an_object_of_a_rebuilt_cache_fails_loudly(small: drt.Cache) -> None:
    drt.cache([1, 2], "small", overwrite=True, progress=False)
    with pytest.raises(StaleCacheError, match="was rebuilt since it was opened"):
        _ = small.metadata
    # The old object's mapped records stay readable: its files are still mapped.
    assert same_record(small.get(5), record(5))


FORMAT_4 = Path(__file__).parent / "data" / "format-4"
"""Caches of ``record(0)`` to ``record(11)`` written by a release before format 5 (indexes
of five columns): ``plain`` is format 3, ``zstd`` format 4."""


@pytest.mark.parametrize(("name", "version"), [("plain", 3), ("zstd", 4)])
def test_caches_written_before_format_5_open_verify_and_grow(
    tmp_path: Path, name: str, version: int
) -> None:
    shutil.copytree(FORMAT_4 / name, tmp_path / name)
    manifest = tmp_path / name / "manifest.json"
    assert json.loads(manifest.read_text())["format_version"] == version
    cache = drt.open(name, root=tmp_path)
    assert all(same_record(cache.get(i, verify=True), record(i)) for i in range(12))
    assert drt.verify(name, root=tmp_path, progress=False).ok
    loader = cache.metadata.drt.loader(4, shuffle=False, collate=list)
    assert [r["caption"] for batch in loader for r in batch] == [f"sample {i}" for i in range(12)]
    # A metadata save keeps the version, so the releases that read the cache still do.
    cache.save_metadata(cache.metadata.with_columns(weight=pl.col("label") + 1.0))
    assert json.loads(manifest.read_text())["format_version"] == version
    # A part appended now has a locator index, and makes the cache format 5.
    new = [record(i) for i in range(12, 20)]
    grown = drt.append(name, new, root=tmp_path, progress=False)
    assert json.loads(manifest.read_text())["format_version"] == 5 == drt._native.FORMAT_VERSION
    assert all(same_record(grown.get(i, verify=True), record(i)) for i in range(20))
    assert drt.verify(name, root=tmp_path, progress=False).ok


def test_every_frame_holds_cache_id_as_one_dtype_old_tables_included(tmp_path: Path) -> None:
    # A table written before cache_id became categorical holds strings.
    shutil.copytree(FORMAT_4 / "plain", tmp_path / "plain")
    old = drt.open("plain", root=tmp_path)
    assert (
        pl.read_parquet_schema(next((old.path / "metadata").glob("*.parquet")))["cache_id"]
        == pl.String
    )
    new = drt.cache((record(i) for i in range(30)), "new", root=tmp_path, progress=False)
    house = pl.Categorical if POLARS_2 else pl.String
    frames = {
        "old metadata": old.metadata,
        "old scan": old.scan().collect(),
        "old scan, filtered by id": old.scan().filter(pl.col("cache_id") == old.cache_id).collect(),
        "new metadata": new.metadata,
        "new scan": new.scan().collect(),
        "list_caches": drt.list_caches(tmp_path),
    }
    dtypes = {name: frame.schema["cache_id"] for name, frame in frames.items()}
    assert dtypes == dict.fromkeys(frames, house)
    assert frames["old scan, filtered by id"].height == 12
    # Frames of both caches concatenate, filter by a Cache.cache_id, and join with what a
    # loader over them saw (no re-encoding: a warning would fail this test).
    links = ["cache_id", "sample_id", "weight"]
    both = pl.concat([old.metadata.select(links), new.metadata.select(links)])
    assert both.filter(pl.col("cache_id") == new.cache_id).height == 30
    loader = both.drt.loader(batch_size=8, seed=0, num_samples=64, collate=list)
    seen = loader.seen(epoch=0)
    assert seen.schema["cache_id"] == house
    assert seen.join(both, on=["cache_id", "sample_id"]).height == 64
    names = both.join(drt.list_caches(tmp_path), on="cache_id")["name"].value_counts()
    assert dict(names.iter_rows()) == {"plain": 12, "new": 30}
    # A categorical id is 4 bytes a row: the loader's three columns take 20 bytes a row.
    if POLARS_2:
        assert new.metadata.select(links).estimated_size() <= 20 * 30 + 256

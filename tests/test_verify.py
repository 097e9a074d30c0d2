"""Verification of whole caches, damage reports, and paths that try to leave the root."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import polars as pl
import pytest

import dataset_rt as drt
from dataset_rt.cli import EXIT_DAMAGED, main
from dataset_rt.errors import CacheCorruptError, CacheNotFoundError


def _index(c: drt.Cache) -> pl.DataFrame:
    """Where each sample lives, decoded from the index's 16-byte locators."""
    raw = pl.read_ipc(c.path / "index.arrow")["locator"].to_list()
    rows = [struct.unpack("<QII", locator) for locator in raw]
    return pl.DataFrame(
        [(i, shard, offset, length) for i, (offset, length, shard) in enumerate(rows)],
        schema=["sample_id", "shard", "offset", "length"],
        orient="row",
    )


def _flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x5A
    path.write_bytes(bytes(data))


def test_an_intact_cache_verifies(small: drt.Cache, capsys: pytest.CaptureFixture[str]) -> None:
    report = small.verify(progress=False)
    assert report.ok, report
    assert report.samples_checked == 200
    assert report.files_checked == small.num_shards + 4  # manifest, index, metadata v1, plan
    assert report.bytes_read >= small.nbytes
    report.raise_if_damaged()
    assert main(["verify", "small", "-q"]) == 0
    assert "intact" in capsys.readouterr().out


def test_flipped_record_bytes_name_the_shard_and_exactly_the_samples_hit(
    small: drt.Cache, capsys: pytest.CaptureFixture[str]
) -> None:
    index = _index(small).filter(pl.col("shard") == 3)
    first, second = index.row(0, named=True), index.row(2, named=True)
    shard = small.path / "shards" / "00003.bin"
    _flip(shard, first["offset"] + first["length"] // 2)
    _flip(shard, second["offset"])
    report = drt.verify("small", progress=False)
    assert not report.ok
    assert report.damaged_sample_ids == [first["sample_id"], second["sample_id"]]
    assert {p.file for p in report.problems} == {"shards/00003.bin"}
    with pytest.raises(CacheCorruptError, match=r"shards/00003.bin: .*checksum"):
        report.raise_if_damaged()
    assert main(["verify", "small", "-q"]) == EXIT_DAMAGED
    out = capsys.readouterr().out
    assert "shards/00003.bin" in out
    assert f"sample_id {first['sample_id']}, {second['sample_id']}" in out


@pytest.mark.parametrize(
    ("damage", "file", "message"),
    [
        ("truncate-shard", "shards/00002.bin", "truncated or overwritten"),
        ("delete-shard", "shards/00001.bin", "file is missing"),
        ("flip-index", "index.arrow", "checksum"),
        ("truncate-index", "index.arrow", "truncated or overwritten"),
        ("garble-manifest", "manifest.json", "not valid JSON"),
        ("flip-metadata", "metadata/v00001.parquet", "checksum"),
        ("delete-metadata", "metadata/v00001.parquet", "file is missing"),
        ("shard-symlink", "shards/00000.bin", "symbolic link"),
    ],
)
def test_every_kind_of_damage_is_reported_with_its_file(
    small: drt.Cache, damage: str, file: str, message: str, tmp_path: Path
) -> None:
    target = small.path / file
    if damage.startswith("truncate"):
        target.write_bytes(target.read_bytes()[:-9])
    elif damage.startswith("delete"):
        target.unlink()
    elif damage.startswith("flip"):
        _flip(target, target.stat().st_size // 2)
    elif damage == "garble-manifest":
        target.write_text("{not json")
    elif damage == "shard-symlink":
        outside = tmp_path / "outside.bin"
        outside.write_bytes(target.read_bytes())
        target.unlink()
        target.symlink_to(outside)
    report = drt.verify("small", progress=False)
    assert not report.ok
    assert any(p.file == file and message in p.message for p in report.problems), report
    if damage in ("truncate-shard", "delete-shard"):
        # Every sample of the lost shard is named, and only those.
        shard = int(Path(file).stem)
        expected = _index(small).filter(pl.col("shard") == shard)["sample_id"].to_list()
        assert report.damaged_sample_ids == expected
    assert main(["verify", "small", "-q"]) == EXIT_DAMAGED


def test_a_flipped_metadata_byte_never_reads_as_data(small: drt.Cache) -> None:
    saved = small.metadata.with_columns(weight=pl.col("sample_id").cast(pl.Float64) + 1)
    version = small.save_metadata(saved)
    path = small.path / "metadata" / f"v{version:05d}.parquet"
    _flip(path, path.stat().st_size // 3)
    with pytest.raises(CacheCorruptError, match=r"v00002.parquet: metadata table fails its"):
        _ = drt.open("small").metadata
    # A scan checks the table before a query first reads it, in any engine (with Polars 2
    # making the scan reads nothing yet; with older Polars it checks at once).
    for query in (
        lambda scan: scan.collect(),
        lambda scan: scan.filter(pl.col("sample_id") < 5).select("weight").collect(),
        lambda scan: scan.select(pl.len()).collect(engine="streaming"),
    ):
        with pytest.raises(CacheCorruptError, match=r"v00002.parquet: metadata table fails its"):
            query(drt.open("small").scan())
    # The earlier version is intact and still readable.
    assert drt.open("small").metadata_at(1).height == 200


def test_metadata_rows_that_do_not_belong_are_reported(small: drt.Cache) -> None:
    # A table written by hand past dataset_rt's checks, with a checksum to match.
    path = small.path / "metadata" / "v00001.parquet"
    small.metadata.with_columns(sample_id=pl.col("sample_id") + 1000).write_parquet(path)
    manifest_path = small.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["metadata_checksums"]["1"] = drt._native.file_checksum(path)[1]
    manifest_path.write_text(json.dumps(manifest))
    report = drt.verify("small", progress=False)
    assert [p.file for p in report.problems] == ["metadata/v00001.parquet"]
    assert "invalid metadata table" in report.problems[0].message


def test_verifying_a_missing_cache(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CacheNotFoundError, match="no cache 'absent'"):
        drt.verify("absent")
    assert main(["verify", "absent"]) == 1
    assert "no cache 'absent'" in capsys.readouterr().err


def test_a_symlinked_cache_directory_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    drt.cache(range(5), "real", root=outside, progress=False)
    root = drt.default_root()
    root.mkdir(parents=True, exist_ok=True)
    (root / "escape").symlink_to(outside / "real", target_is_directory=True)
    with pytest.raises(CacheCorruptError, match="escape: is a symbolic link"):
        drt.open("escape")
    with pytest.raises(CacheCorruptError, match="symbolic link"):
        drt.cache(range(3), "escape", overwrite=True, progress=False)
    assert "escape" not in drt.list_caches()["name"].to_list()
    # Nothing outside the root was touched.
    assert len(drt.open("real", root=outside)) == 5


@pytest.mark.parametrize("name", ["../x", "/abs", "a/../../b", "..", "."])
def test_names_that_leave_the_root_are_refused(name: str) -> None:
    before = set(os.listdir(drt.default_root().parent))
    with pytest.raises(drt.errors.CacheNameError):
        drt.cache(range(3), name, progress=False)
    with pytest.raises(drt.errors.CacheNameError):
        drt.open(name)
    assert set(os.listdir(drt.default_root().parent)) == before

"""drt.append: records added to a cache as a new part, with a new metadata version."""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import polars as pl
import pytest
from helpers import python_child, record, same_record

import dataset_rt as drt
from dataset_rt.errors import ArgumentError, CacheNotFoundError, MetadataError


@pytest.fixture
def base() -> drt.Cache:
    return drt.cache(
        [record(i) for i in range(30)],
        "growing",
        metadata=lambda r: {"label": r["label"]},
        shard_size=16 << 10,
        progress=False,
    )


def _digests(cache: drt.Cache, parts: bool = True) -> dict[str, str]:
    """The payload files (shards and indexes) and their contents."""
    return {
        str(p.relative_to(cache.path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(cache.path.rglob("*"))
        if p.is_file()
        and p.parent.name != "metadata"
        and p.name != "manifest.json"
        and (parts or not p.is_relative_to(cache.path / "parts"))
    }


def _i(r: dict[str, object]) -> int:
    """The index a record of helpers.record was made from (its caption says it)."""
    return int(str(r["caption"]).split()[1])


def _unchanged(cache: drt.Cache, table: pl.DataFrame, files: dict[str, str]) -> bool:
    return len(cache) == table.height and cache.metadata.equals(table) and _digests(cache) == files


def test_appended_records_follow_the_old_ones_which_stay_untouched(base: drt.Cache) -> None:
    reweighted = base.metadata.with_columns(weight=pl.col("sample_id").cast(pl.Float64) + 1)
    base.save_metadata(reweighted)
    before = _digests(base)
    grown = drt.append(
        "growing",
        (record(i) for i in range(30, 55)),
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )
    assert len(grown) == 55 and grown.cache_id == base.cache_id
    assert (grown.num_parts, base.num_parts) == (2, 1)
    assert all(same_record(grown.get(i), record(i)) for i in (0, 29, 30, 54))
    assert [_i(r) for r in grown.get_many([54, 3, 31])] == [54, 3, 31]
    # Old files are byte for byte what they were; the new part sits beside them.
    after = _digests(grown)
    assert {k: after[k] for k in before} == before
    assert sorted({k.split("/")[1] for k in after if k.startswith("parts/")}) == ["00001"]
    # Old rows keep their values and weights; new rows get theirs and weight 1.
    table = grown.metadata
    assert table.columns == ["cache_id", "sample_id", "label", "weight"]
    assert table["sample_id"].to_list() == list(range(55))
    assert table.filter(pl.col("sample_id") < 30).equals(reweighted)
    assert table["weight"][30:].to_list() == [1.0] * 25
    assert table["label"][30:].to_list() == [record(i)["label"] for i in range(30, 55)]
    assert grown.metadata_versions()["version"].to_list() == [1, 2, 3]
    # The old Cache object follows: its length grows when it next reads the manifest.
    assert base.metadata.height == 55 and len(base) == 55
    assert drt.verify("growing", progress=False).ok
    # A loader over the grown cache, shuffled (its saved plan) and not, reads both parts.
    seen = {_i(r) for b in grown.scan().drt.loader(batch_size=64, seed=1, collate=list) for r in b}
    assert seen & set(range(30)) and seen & set(range(30, 55))
    ordered = grown.metadata.drt.loader(batch_size=64, shuffle=False, collate=list)
    assert [_i(r) for b in ordered for r in b] == list(range(55))


def test_frames_and_loaders_made_before_an_append_read_what_they_were_made_from(
    base: drt.Cache,
) -> None:
    frame, scan = base.metadata, base.scan()
    loader = frame.drt.loader(batch_size=16, seed=3, num_samples=200, collate=list)
    drt.append("growing", [record(i) for i in range(30, 40)], progress=False)
    for made in (loader, scan.drt.loader(batch_size=16, seed=3, num_samples=200, collate=list)):
        ids = [_i(r) for b in made for r in b]
        assert len(ids) == 200 and max(ids) < 30
    assert scan.collect().height == 30  # the version it scans
    assert drt.open("growing").scan().collect().height == 40


def test_several_appends_and_workers_read_every_part(base: drt.Cache) -> None:
    for start in (30, 35, 50):
        drt.append("growing", [record(i) for i in range(start, start + 5)], progress=False)
    grown = drt.open("growing")
    ids = [*range(40), *range(50, 55)]
    assert len(grown) == 45
    assert [_i(grown.get(i)) for i in range(45)] == ids
    loader = grown.metadata.drt.loader(batch_size=8, shuffle=False, collate=list, num_workers=2)
    assert sorted(_i(r) for b in loader for r in b) == sorted(ids)
    assert drt.verify("growing", progress=False).ok


def test_columns_one_side_lacks_are_null_on_the_other(base: drt.Cache) -> None:
    grown = drt.append(
        "growing", [record(i) for i in range(30, 33)], metadata=lambda r: {"kind": "new"}
    )
    table = grown.metadata
    assert table.columns == ["cache_id", "sample_id", "label", "kind", "weight"]
    assert table["kind"].to_list() == [None] * 30 + ["new"] * 3
    assert table["label"][30:].to_list() == [None] * 3
    # Without a metadata function, the new rows have ids and weights only.
    again = drt.append("growing", [record(40)], progress=False)
    assert again.metadata.row(-1) == (base.cache_id, 33, None, None, 1.0)


def test_an_append_to_an_empty_cache(tmp_path: Path) -> None:
    empty = drt.cache([], "empty-then-full", root=tmp_path, progress=False)
    assert len(empty) == 0
    grown = drt.append("empty-then-full", [b"a", b"b"], root=tmp_path, progress=False)
    assert [grown.get(0), grown.get(1)] == [b"a", b"b"]
    assert grown.metadata["sample_id"].to_list() == [0, 1]


def test_an_empty_source_changes_nothing(base: drt.Cache) -> None:
    same = drt.append("growing", [], progress=False)
    assert len(same) == 30 and same.metadata_versions().height == 1
    assert not any((base.path / "parts").iterdir())


@pytest.mark.parametrize(
    ("source", "metadata", "error", "message"),
    [
        (
            [record(30), record(31)],
            lambda r: {"label": str(r["label"])},
            MetadataError,
            r"'label' \(Int64 in the cache, String appended\)",
        ),
        ([record(30), lambda: 1], None, drt.errors.SerializationError, "record 1 could not"),
    ],
)
def test_a_failed_append_leaves_the_cache_as_it_was(
    base: drt.Cache, source: list[object], metadata: object, error: type, message: str
) -> None:
    table, files = base.metadata, _digests(base)
    with pytest.raises(error, match=message):
        drt.append("growing", source, metadata=metadata, progress=False)  # type: ignore[arg-type]
    assert _unchanged(drt.open("growing"), table, files)
    assert not any((base.path / "parts").iterdir())
    assert drt.verify("growing", progress=False).ok


def test_info_counts_the_parts(base: drt.Cache, capsys: pytest.CaptureFixture[str]) -> None:
    from dataset_rt.cli import main

    grown = drt.append("growing", [record(30)], progress=False)
    assert main(["info", "growing"]) == 0
    assert f"in {grown.num_shards} shard(s), 2 parts" in capsys.readouterr().out
    assert ">parts</th><td style='text-align:left'>2</td>" in grown._repr_html_()


def test_append_errors_name_what_is_wrong(base: drt.Cache) -> None:
    with pytest.raises(CacheNotFoundError):
        drt.append("no-such-cache", [1], progress=False)
    drt.cache([1, 2], "custom-ser", serializer=lambda x: bytes([x]), decode=lambda b: b[0])
    with pytest.raises(ArgumentError, match="custom serializer"):
        drt.append("custom-ser", [3], progress=False)


# A child that appends 40 records to "growing" and is killed at the engine's kill point
# named by $DATASET_RT_TEST_KILL_AT (see CONTRIBUTING.md).
APPEND_AND_DIE = """
import os
from helpers import record
import dataset_rt as drt
drt.append("growing", [record(i) for i in range(30, 70)], progress=False,
           num_proc=int(os.environ["NUM_PROC"]))
print("finished")
"""


@pytest.mark.parametrize("num_proc", [1, 3])
@pytest.mark.parametrize(
    "kill_at", ["append-part-written", "append-part-moved", "metadata-renamed"]
)
def test_a_killed_append_leaves_the_cache_as_it_was_and_the_next_one_clears_it(
    base: drt.Cache, kill_at: str, num_proc: int
) -> None:
    table, files = base.metadata, _digests(base)
    env = {"DATASET_RT_TEST_KILL_AT": kill_at, "NUM_PROC": str(num_proc)}
    child = python_child(APPEND_AND_DIE, env)
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, (child.returncode, out, err)
    kept = drt.open("growing")
    # Readers see the cache as it was (a part moved into place but never listed is not
    # read, and the next append removes it).
    assert len(kept) == 30 and kept.metadata.equals(table)
    assert _digests(kept, parts=False) == files
    assert drt.verify("growing", progress=False).ok
    grown = drt.append("growing", [record(i) for i in range(30, 35)], progress=False)
    assert len(grown) == 35 and _i(grown.get(34)) == 34
    assert sorted(p.name for p in (base.path / "parts").iterdir()) == ["00001"]


APPEND_BLOCK = """
import sys
from helpers import record
import dataset_rt as drt
start = int(sys.argv[1])
drt.append("growing", [record(i) for i in range(start, start + 200)], progress=False)
"""


def test_concurrent_appends_take_turns(base: drt.Cache) -> None:
    children = [
        python_child(APPEND_BLOCK.replace("int(sys.argv[1])", str(start))) for start in (1000, 2000)
    ]
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    grown = drt.open("growing")
    assert len(grown) == 430
    ids = [_i(grown.get(i)) for i in range(30, 430)]
    # Each append's records are one run of ids, in its order; the two runs in either order.
    assert sorted([ids[:200], ids[200:]]) == [list(range(1000, 1200)), list(range(2000, 2200))]
    assert grown.metadata.height == 430
    assert drt.verify("growing", progress=False).ok


def test_verify_names_damage_in_a_part_by_cache_wide_sample_ids(base: drt.Cache) -> None:
    grown = drt.append("growing", [record(i) for i in range(30, 40)], progress=False)
    shard = grown.path / "parts" / "00001" / "shards" / "00000.bin"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # inside the last record
    shard.write_bytes(bytes(data))
    report = drt.verify("growing", progress=False)
    damaged = [p for p in report.problems if "fail their checksum" in p.message]
    assert [p.file for p in damaged] == ["parts/00001/shards/00000.bin"]
    assert damaged[0].sample_ids == [39]


def test_an_append_in_several_processes_gives_the_same_records_and_metadata(
    base: drt.Cache,
) -> None:
    def meta(r: dict[str, object]) -> dict[str, object]:
        return {"label": r["label"], "weight": 2.0}

    new = [record(i) for i in range(30, 131)]
    drt.cache([record(i) for i in range(30)], "twin", metadata=lambda r: {"label": r["label"]})
    one = drt.append("twin", new, metadata=meta, progress=False)
    many = drt.append("growing", new, metadata=meta, num_proc=3, progress=False)
    assert (many.num_parts, one.num_parts) == (4, 2)
    assert [many.get_bytes(i) for i in range(131)] == [one.get_bytes(i) for i in range(131)]
    assert many.metadata.drop("cache_id").equals(one.metadata.drop("cache_id"))
    assert drt.verify("growing", progress=False).ok
    loader = many.metadata.drt.loader(batch_size=50, shuffle=False, collate=list)
    assert [_i(r) for b in loader for r in b] == list(range(131))
    with pytest.raises(ArgumentError, match=r"num_proc=2 needs a source with __len__"):
        drt.append("growing", (record(i) for i in range(3)), num_proc=2, progress=False)


def test_a_killed_worker_fails_the_append_and_leaves_the_cache_as_it_was(
    base: drt.Cache,
) -> None:
    from helpers import Squares

    table, files = base.metadata, _digests(base)
    with pytest.raises(drt.errors.WorkerError, match=r"records 50 to 99 died \(signal SIGKILL\)"):
        drt.append("growing", Squares(100, die_at=70), num_proc=2, progress=False)
    assert _unchanged(drt.open("growing"), table, files)
    assert not any((base.path / "parts").iterdir())

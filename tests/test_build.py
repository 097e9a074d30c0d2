"""drt.cache(): building, reuse by name, serializers, metadata, and bad input."""

from __future__ import annotations

import pickle
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from helpers import record, same_record

import dataset_rt as drt
from dataset_rt.errors import (
    ArgumentError,
    CacheNameError,
    DatasetRTError,
    MetadataError,
    SerializationError,
    WeightError,
)


def test_list_generator_and_callable_sources_round_trip() -> None:
    records = [record(i) for i in range(50)]
    from_list = drt.cache(records, "from-list", progress=False)
    from_gen = drt.cache((record(i) for i in range(50)), "from-gen", progress=False)
    from_fn = drt.cache(lambda: (record(i) for i in range(50)), "from-fn", progress=False)
    for c in (from_list, from_gen, from_fn):
        assert len(c) == 50
        for i in (0, 17, 49):
            assert same_record(c.get(i), records[i])
            assert c.get_bytes(i) == pickle.dumps(records[i], protocol=5)


class _Squares:
    """A map-style dataset as PyTorch users write them: no __iter__, and indices past the
    end wrap around instead of raising IndexError (so Python's fallback iteration would
    never stop)."""

    def __init__(self, n: int, fail_at: int = -1) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index == self.fail_at:
            raise ValueError("bad file")
        return {"i": index % self.n, "sq": np.full(3, (index % self.n) ** 2)}


def test_a_map_style_dataset_is_read_at_every_index_once() -> None:
    torch_data = pytest.importorskip("torch.utils.data")

    class TorchSquares(torch_data.Dataset):  # type: ignore[misc, name-defined]
        def __len__(self) -> int:
            return 40

        def __getitem__(self, index: int) -> dict[str, Any]:
            return _Squares(40)[index]

    for source, name in ((TorchSquares(), "torch-map"), (lambda: _Squares(40), "callable-map")):
        c = drt.cache(source, name, metadata=lambda r: {"i": r["i"]}, progress=False)
        assert len(c) == 40
        assert c.metadata["i"].to_list() == list(range(40))
        assert [c.get(i)["i"] for i in range(40)] == list(range(40))
        assert int(c.get(39)["sq"][0]) == 39**2


def test_a_failing_map_style_record_names_its_index() -> None:
    with pytest.raises(ValueError, match="bad file") as caught:
        drt.cache(_Squares(20, fail_at=13), "map-fails", progress=False)
    if hasattr(caught.value, "__notes__"):  # Python 3.11+
        assert "while reading record 13 of the source" in caught.value.__notes__[0]
    with pytest.raises(drt.errors.CacheNotFoundError):
        drt.open("map-fails")


def test_same_name_is_reused_without_touching_the_source(tmp_path: Path) -> None:
    calls = []

    def source() -> Any:
        calls.append(1)
        return [record(i) for i in range(5)]

    first = drt.cache(source, "reuse", progress=False)
    again = drt.cache(source, "reuse", progress=False)
    assert calls == [1], "the callable source was called again for an existing cache"
    assert again.cache_id == first.cache_id

    def exploding() -> Any:
        raise AssertionError("iterated")
        yield  # pragma: no cover

    assert drt.cache(exploding(), "reuse", progress=False).cache_id == first.cache_id


def test_overwrite_rebuilds_with_a_new_cache_id() -> None:
    old = drt.cache([1, 2, 3], "ow", progress=False)
    new = drt.cache([4, 5], "ow", overwrite=True, progress=False)
    assert new.cache_id != old.cache_id
    assert len(new) == 2 and new.get(0) == 4
    assert drt.open("ow").cache_id == new.cache_id


def test_open_and_root_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = tmp_path / "explicit"
    drt.cache(range(3), "rooted", root=explicit, progress=False)
    assert (explicit / "rooted" / "manifest.json").is_file()
    assert drt.open("rooted", root=explicit).get(2) == 2
    with pytest.raises(drt.errors.CacheNotFoundError):
        drt.open("rooted")  # not under DATASET_RT_HOME
    monkeypatch.setenv("DATASET_RT_HOME", str(explicit))
    assert drt.open("rooted").get(1) == 1
    assert drt.default_root() == explicit
    monkeypatch.delenv("DATASET_RT_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert drt.default_root() == tmp_path / "home" / ".cache" / "dataset_rt"


def test_metadata_table_has_ids_attributes_and_unit_weights() -> None:
    c = drt.cache(
        [record(i) for i in range(10)],
        "meta",
        metadata=lambda r: {"label": r["label"], "caption": r["caption"], "big": r["label"] > 2},
        progress=False,
    )
    df = c.metadata
    assert df.columns == ["cache_id", "sample_id", "label", "caption", "big", "weight"]
    assert df.schema["sample_id"] == pl.Int64
    assert df.schema["label"] == pl.Int64
    assert df.schema["big"] == pl.Boolean
    assert df.schema["weight"] == pl.Float64
    assert df["cache_id"].unique().to_list() == [c.cache_id]
    assert df["sample_id"].to_list() == list(range(10))
    assert df["label"].to_list() == [i % 5 for i in range(10)]
    assert df["weight"].to_list() == [1.0] * 10
    assert c.scan().filter(pl.col("label") == 3).collect()["sample_id"].to_list() == [3, 8]


def test_metadata_accepts_numpy_scalars_none_and_an_initial_weight() -> None:
    values = [
        {
            "label": np.int64(i),
            "score": np.float32(i / 2),
            "note": None if i % 2 else "x",
            "weight": i + 1,
        }
        for i in range(4)
    ]
    c = drt.cache(range(4), "np-meta", metadata=lambda i: values[i], progress=False)
    df = c.metadata
    assert df["label"].to_list() == [0, 1, 2, 3]
    assert df["score"].to_list() == [0.0, 0.5, 1.0, 1.5]
    assert df["note"].to_list() == ["x", None, "x", None]
    assert df["weight"].to_list() == [1.0, 2.0, 3.0, 4.0]


def test_no_metadata_function_still_gives_ids_and_weights() -> None:
    df = drt.cache(range(3), "plain", progress=False).metadata
    assert df.columns == ["cache_id", "sample_id", "weight"]


def test_empty_source_makes_an_empty_cache_valid_everywhere() -> None:
    c = drt.cache([], "empty", metadata=lambda r: {"x": 1}, progress=False)
    assert len(c) == 0
    assert c.metadata.height == 0
    with pytest.raises(drt.errors.SampleIndexError):
        c.get(0)
    assert drt.open("empty").cache_id == c.cache_id
    report = drt.verify("empty", progress=False)
    assert report.ok, str(report)
    c.save_metadata(c.metadata)  # its empty table is a valid table
    assert drt.verify("empty", progress=False).ok
    with pytest.raises(drt.errors.MetadataError, match="no rows .*its cache is empty"):
        c.metadata.drt.loader(batch_size=4)


def test_dill_and_custom_serializers() -> None:
    c = drt.cache([lambda x: x + 1], "dill", serializer="dill", progress=False)
    assert c.serializer == "dill"
    assert drt.open("dill").get(0)(1) == 2

    def encode(r: int) -> bytes:
        return str(r).encode()

    c = drt.cache(range(3), "custom", serializer=encode, decode=lambda b: int(b), progress=False)
    assert c.serializer.startswith("custom:") and c.serializer.endswith("encode")
    assert c.get(2) == 2
    reopened = drt.open("custom")
    assert reopened.get_bytes(1) == b"1"
    with pytest.raises(SerializationError, match="pass decode="):
        reopened.get(1)
    assert reopened.get(1, decode=int) == 1
    assert drt.open("custom", decode=int).get(2) == 2


def test_progress_line_reports_records_and_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    drt.cache(range(100), "progress", progress=True)
    err = capsys.readouterr().err
    assert "caching 'progress': 100/100 (100%) records" in err
    assert "rec/s" in err
    size = re.search(r"records, ([\d.]+) (B|KiB|MiB)", err)
    assert size and float(size.group(1)) > 0, err  # the bytes written, not 0 B
    drt.cache(range(100), "quiet", progress=False)
    assert capsys.readouterr().err == ""


def test_progress_shows_the_first_record_at_once_and_redraws_by_time(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataset_rt import progress

    monkeypatch.setattr(progress, "_interactive", lambda stream: True)  # as on a terminal
    seen: list[str] = []

    def slow_records() -> Iterator[bytes]:
        for i in range(4):
            if i:
                seen.append(capsys.readouterr().err)
                time.sleep(0.3)  # a slow record: the line must move while it is made
            yield bytes(1000)

    drt.cache(slow_records(), "slow", progress=True)
    seen.append(capsys.readouterr().err)
    assert "caching 'slow': 1 records" in seen[0], "the first record shows at once"
    assert all("\r" in s for s in seen[1:]), seen
    assert "caching 'slow': 4 records" in seen[-1]


def test_builds_leave_no_lock_files(tmp_path: Path) -> None:
    root = tmp_path / "caches"
    drt.cache(range(3), "built", root=root, progress=False)
    with pytest.raises(SerializationError):
        drt.cache([1, lambda: 2], "failed", root=root, progress=False)
    c = drt.open("built", root=root)
    c.save_metadata(c.metadata.with_columns(weight=pl.lit(2.0)))
    assert sorted(p.name for p in root.iterdir()) == ["built"]


# -- bad input ------------------------------------------------------------------------------
def test_unserializable_record_names_its_position() -> None:
    records = [1, 2, lambda: 3, 4]
    with pytest.raises(SerializationError, match="record 2 could not be serialized with pickle"):
        drt.cache(records, "bad-record", progress=False)
    with pytest.raises(drt.errors.CacheNotFoundError):
        drt.open("bad-record")


def test_serializer_returning_non_bytes() -> None:
    with pytest.raises(SerializationError, match="returned str for record 0"):
        drt.cache([1], "bad-ser", serializer=lambda r: "x", progress=False)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([{"a": 1}, {"a": [1, 2]}], r"metadata key 'a' of record 1 is list"),
        ([{"a": 1}, {"a": 1.5}], r"'a' is float in record 1 but int in earlier records"),
        (
            [{"a": 1}, {"b": 1}],
            r"different keys for record 1 .*missing \['a'\].*unexpected \['b'\]",
        ),
        ([{"a": 1}, {"a": 1, "b": 2}], r"different keys for record 1"),
        ([{"sample_id": 1}], r"key 'sample_id' for record 0"),
        ([{"a": 1}, [("a", 1)]], r"returned list for record 1"),
        ([{"a": np.zeros(3)}], r"'a' of record 0 is ndarray"),
        ([{"a": 1}, {"a": 2**70}], r"key 'a' of record 1 is 1180591620717411303424, outside"),
        ([{1: 1}], r"key 1 for record 0; keys must be str"),
    ],
)
def test_bad_metadata_is_rejected_naming_record_and_key(values: list[Any], message: str) -> None:
    with pytest.raises(MetadataError, match=message):
        drt.cache(range(len(values)), "bad-meta", metadata=lambda i: values[i], progress=False)
    with pytest.raises(drt.errors.CacheNotFoundError):
        drt.open("bad-meta")


def test_metadata_function_that_raises() -> None:
    def meta(r: int) -> dict[str, int]:
        if r == 3:
            raise KeyError("label")
        return {"x": r}

    with pytest.raises(MetadataError, match="metadata\\(\\) raised on record 3"):
        drt.cache(range(5), "meta-raises", metadata=meta, progress=False)


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf"), "heavy", 1e308])
def test_bad_initial_weights(weight: Any) -> None:
    with pytest.raises(WeightError):
        drt.cache(range(2), "bad-weight", metadata=lambda i: {"weight": weight}, progress=False)


@pytest.mark.parametrize("name", ["", "a/b", "..", "../escape", ".hidden", "has space", "a\\b"])
def test_invalid_names(name: str) -> None:
    with pytest.raises(CacheNameError) as info:
        drt.cache([1], name, progress=False)
    assert isinstance(info.value, ValueError)
    assert f"invalid cache name {name!r}" in str(info.value)
    with pytest.raises(CacheNameError):
        drt.open(name)


def test_bad_arguments() -> None:
    with pytest.raises(ArgumentError, match="serializer must be"):
        drt.cache([1], "x", serializer="json", progress=False)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match=r"source must be an iterable of records, a map-style"):
        drt.cache(42, "x", progress=False)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="alignment"):
        drt.cache([1], "x", alignment=3, progress=False)
    with pytest.raises(ArgumentError, match="shard_size"):
        drt.cache([1], "x", shard_size=10, progress=False)


def test_a_failed_rebuild_keeps_the_existing_cache(tmp_path: Path) -> None:
    good = drt.cache(range(10), "keep", progress=False)

    def failing() -> Any:
        yield 1
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        drt.cache(failing(), "keep", overwrite=True, progress=False)
    with pytest.raises(SerializationError):
        drt.cache([lambda: 0], "keep", overwrite=True, progress=False)
    kept = drt.open("keep")
    assert kept.cache_id == good.cache_id
    assert [kept.get(i) for i in range(10)] == list(range(10))
    leftovers = [p.name for p in kept.root.iterdir() if p.name.startswith(".keep.build")]
    assert leftovers == []


def test_errors_are_catchable_as_builtins() -> None:
    with pytest.raises(FileNotFoundError):
        drt.open("nope")
    with pytest.raises(ValueError, match="could not be serialized"):
        drt.cache([lambda: 0], "x", progress=False)
    assert issubclass(drt.errors.CacheCorruptError, OSError)
    assert issubclass(drt.errors.CacheNotFoundError, DatasetRTError)

"""drt.cache(num_proc=k): several processes write a cache's parts; the result is the same."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import Squares, record

import dataset_rt as drt
from dataset_rt.errors import ArgumentError, CacheNotFoundError, SerializationError, WorkerError


def _contents(cache: drt.Cache) -> tuple[list[bytes], Any]:
    return [cache.get_bytes(i) for i in range(len(cache))], cache.metadata.drop("cache_id")


@pytest.mark.parametrize("num_proc", [2, 3])
def test_any_num_proc_gives_the_same_records_and_metadata(num_proc: int) -> None:
    def meta(r: dict[str, Any]) -> dict[str, Any]:
        return {"tag": r["tag"], "weight": 1.0 + r["i"] % 2}

    one = drt.cache(Squares(301), "squares-1", metadata=meta, shard_size=4096, progress=False)
    many = drt.cache(
        Squares(301), f"squares-{num_proc}", metadata=meta, shard_size=4096, num_proc=num_proc
    )
    assert many.num_parts == num_proc and one.num_parts == 1
    records, table = _contents(many)
    expected_records, expected_table = _contents(one)
    assert records == expected_records
    assert table.equals(expected_table)
    assert drt.verify(f"squares-{num_proc}", progress=False).ok
    loader = many.metadata.drt.loader(batch_size=64, shuffle=False, collate=list)
    assert [r["i"] for b in loader for r in b] == list(range(301))


def test_lists_and_arrays_are_split_and_lambdas_travel() -> None:
    records = [record(i) for i in range(100)]
    cache = drt.cache(
        records, "listed", metadata=lambda r: {"label": r["label"]}, num_proc=2, progress=False
    )
    assert cache.metadata["label"].to_list() == [r["label"] for r in records]
    assert cache.get(99)["caption"] == "sample 99"
    arrays = drt.cache(np.arange(50).reshape(25, 2), "arrays", num_proc=2, progress=False)
    assert [int(arrays.get(i)[1]) for i in range(25)] == [2 * i + 1 for i in range(25)]
    # More processes than records: one record each at most.
    tiny = drt.cache([b"a", b"b"], "tiny", serializer=bytes, decode=bytes, num_proc=8)
    assert [tiny.get(0), tiny.get(1)] == [b"a", b"b"]


def test_a_generator_with_num_proc_is_refused() -> None:
    with pytest.raises(ArgumentError, match=r"num_proc=2 needs a source with __len__"):
        drt.cache((i for i in range(10)), "gen", num_proc=2, progress=False)
    with pytest.raises(ArgumentError, match="num_proc must be a positive int"):
        drt.cache([1], "bad", num_proc=0, progress=False)


def test_a_failing_record_in_a_worker_names_its_index_and_nothing_is_built() -> None:
    with pytest.raises(ValueError, match="unreadable file for 250"):
        drt.cache(Squares(300, fail_at=250), "fails", num_proc=2, progress=False)
    with pytest.raises(SerializationError, match="record 260 could not be serialized"):
        drt.cache([1] * 260 + [lambda: 0], "unpicklable", num_proc=2, progress=False)
    for name in ("fails", "unpicklable"):
        with pytest.raises(CacheNotFoundError):
            drt.open(name)


def test_a_killed_worker_fails_the_build_with_nothing_visible(tmp_path: Any) -> None:
    with pytest.raises(WorkerError, match=r"records 150 to 299 died \(signal SIGKILL\)"):
        drt.cache(Squares(300, die_at=200), "killed", root=tmp_path, num_proc=2, progress=False)
    with pytest.raises(CacheNotFoundError):
        drt.open("killed", root=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if "killed" in p.name] == []
    rebuilt = drt.cache(Squares(300), "killed", root=tmp_path, num_proc=2, progress=False)
    assert rebuilt.get(299)["i"] == 299

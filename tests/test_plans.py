"""Sampling plans saved with each metadata version, mapped by loaders over ``cache.scan()``."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

import dataset_rt as drt


def draws(frame: pl.DataFrame | pl.LazyFrame, **options: Any) -> list[int]:
    loader = frame.drt.loader(batch_size=16, seed=5, collate=list, **options)
    return [int(r["x"][0]) for batch in loader for r in batch]


def plan_of(cache: drt.Cache, version: int) -> Path:
    return cache.path / "metadata" / f"v{version:05d}.plan"


@pytest.fixture
def cache() -> drt.Cache:
    return drt.cache(
        ({"x": np.full(4, i), "label": i % 4} for i in range(200)),
        "planned",
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )


def test_each_saved_version_has_a_plan_that_a_scan_loader_maps(cache: drt.Cache) -> None:
    manifest = drt._native.Store(str(cache.root)).manifest("planned")
    assert set(manifest.plan_checksums) == {1}
    first = plan_of(cache, 1).stat()
    scanned = cache.scan().drt.loader(batch_size=16, seed=5, collate=list)
    assert scanned._spec.plan == str(plan_of(cache, 1))  # mapped, not written anew
    eager = cache.metadata.drt.loader(batch_size=16, seed=5, collate=list)
    assert scanned.state_dict() == eager.state_dict()  # the same plan, byte for byte
    assert draws(cache.scan()) == draws(cache.metadata)
    assert plan_of(cache, 1).stat().st_mtime_ns == first.st_mtime_ns  # built once

    # A new version has a plan of its own; loaders over the old one are unaffected.
    cache.save_metadata(cache.metadata.with_columns(weight=pl.col("label").cast(pl.Float64) + 1))
    assert plan_of(cache, 2).is_file()
    assert cache.scan().drt.loader(batch_size=16)._spec.plan == str(plan_of(cache, 2))
    assert draws(cache.scan()) == draws(cache.metadata) != draws(cache.metadata_at(1))
    assert draws(cache.scan(), num_workers=2) == draws(cache.scan())  # workers map it too


def mapped(path: Path) -> int:
    """How many mappings of ``path`` this process holds."""
    with open("/proc/self/maps") as maps:
        return sum(line.rstrip("\n").endswith(str(path)) for line in maps)


def test_a_loader_keeps_its_plan_mapped_between_epochs_and_lets_it_go_with_it(
    cache: drt.Cache,
) -> None:
    # The next epoch then shares the mapping, and the pages the last one touched, instead
    # of faulting them in again (a page of the plan for most draws of a sparse pass).
    edited = cache.metadata.with_columns(weight=pl.col("label").drt.balance())
    loader = edited.drt.loader(batch_size=16, seed=5, collate=list)
    plan = Path(loader._spec.plan)  # its own, in a scratch directory
    assert mapped(plan) == 0
    first = [int(r["x"][0]) for batch in loader for r in batch]
    assert mapped(plan) == 1
    second = [int(r["x"][0]) for batch in loader for r in batch]  # the next epoch's draws
    assert mapped(plan) == 1 and first != second
    del loader
    gc.collect()
    assert mapped(plan) == 0


def test_a_cache_keeps_its_saved_plan_mapped_for_each_new_loader_while_it_lives() -> None:
    cache = drt.cache(
        ({"x": np.full(4, i), "label": i % 4} for i in range(200)),
        "held",
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )
    cache.save_metadata(cache.metadata.with_columns(weight=pl.col("label").drt.balance()))
    plan = plan_of(cache, 2)
    assert mapped(plan) == 0
    for _ in range(2):  # a new loader over the version each time, as a new pass would make
        assert len(draws(cache.scan())) == 200
        gc.collect()
        assert mapped(plan) == 1
    del cache
    gc.collect()
    assert mapped(plan) == 0


def test_ranks_map_the_same_saved_plan_and_share_out_its_draws(cache: drt.Cache) -> None:
    ranks = [
        cache.scan().drt.loader(batch_size=16, seed=5, collate=list, rank=r, world_size=2)
        for r in (0, 1)
    ]
    assert {loader._spec.plan for loader in ranks} == {str(plan_of(cache, 1))}
    per_rank = [[int(r["x"][0]) for batch in loader for r in batch] for loader in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == 100
    assert sorted(per_rank[0] + per_rank[1]) == sorted(draws(cache.scan()))


def test_a_changed_scan_or_an_unshuffled_loader_builds_its_own_plan(cache: drt.Cache) -> None:
    kept = cache.scan().filter(pl.col("label") < 2)
    loader = kept.drt.loader(batch_size=16, seed=5, collate=list)
    assert loader._spec.plan != str(plan_of(cache, 1))
    assert draws(kept) == draws(kept.collect())
    ordered = cache.scan().drt.loader(batch_size=16, shuffle=False, collate=list)
    assert [int(r["x"][0]) for b in ordered for r in b] == list(range(200))


def test_a_damaged_or_lost_plan_is_passed_over_and_put_back(cache: drt.Cache) -> None:
    expected = draws(cache.metadata)
    path, saved = plan_of(cache, 1), plan_of(cache, 1).read_bytes()

    def maps_saved_plan(**options: Any) -> bool:
        loader = cache.scan().drt.loader(batch_size=16, **options)
        return bool(loader._spec.plan == str(path))

    damaged = bytearray(saved)
    damaged[len(damaged) // 2] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(damaged))
    report = cache.verify(progress=False)
    assert [p.file for p in report.problems] == ["metadata/v00001.plan"]
    assert "delete the file" in report.problems[0].message
    assert maps_saved_plan()  # unchecked, as records are unless verify=True
    assert not maps_saved_plan(verify=True)  # checked: passed over, and put back
    assert path.read_bytes() == saved and cache.verify(progress=False).ok

    os.truncate(path, 100)  # torn: its size no longer matches its header
    assert draws(cache.scan()) == expected
    assert path.read_bytes() == saved and maps_saved_plan()
    path.unlink()
    assert draws(cache.scan()) == expected
    assert path.read_bytes() == saved and maps_saved_plan()
    leftovers = [p.name for p in path.parent.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_an_empty_cache_has_no_plan() -> None:
    empty = drt.cache([], "empty-planned", progress=False)
    manifest = drt._native.Store(str(empty.root)).manifest("empty-planned")
    assert manifest.plan_checksums == {}
    assert not plan_of(empty, 1).exists()


def _identity(record: bytes) -> bytes:
    return record


@pytest.mark.slow
def test_ten_million_rows_load_from_their_saved_plan_and_from_an_edited_frame() -> None:
    rows = 10_000_000
    cache = drt.cache(
        (i.to_bytes(8, "little") for i in range(rows)),
        "ten-million",
        serializer=_identity,
        progress=False,
    )
    manifest = drt._native.Store(str(cache.root)).manifest("ten-million")
    assert manifest.num_samples == rows and set(manifest.plan_checksums) == {1}

    def first_ids(frame: pl.DataFrame | pl.LazyFrame) -> list[int]:
        loader = frame.drt.loader(batch_size=256, seed=1, decode=bytes, collate=list)
        return [int.from_bytes(r, "little") for r in next(iter(loader))]

    scanned = first_ids(cache.scan())
    assert scanned == first_ids(cache.metadata) and len(set(scanned)) > 250
    even = cache.metadata.filter(pl.col("sample_id") % 2 == 0).with_columns(
        weight=pl.col("sample_id").cast(pl.Float64) + 1.0
    )
    ids = first_ids(even)
    assert all(i % 2 == 0 for i in ids) and len(ids) == 256

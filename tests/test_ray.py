"""dataset_rt.ray.cache: a Ray Data dataset written by Ray's own write tasks, on a real
local cluster (``ray.init(num_cpus=2)``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import ray

import dataset_rt as drt
import dataset_rt.ray as drt_ray
from dataset_rt.errors import ArgumentError, CacheNotFoundError

pytestmark = [
    pytest.mark.slow,
    # Ray Data warns about its own deprecated settings when it copies its context.
    pytest.mark.filterwarnings(r"ignore::DeprecationWarning:ray\..*"),
]


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _rows(n: int, blocks: int = 6) -> ray.data.Dataset:
    return ray.data.range(n, override_num_blocks=blocks).map(
        lambda r: {"id": r["id"], "x": np.full(3, r["id"], dtype=np.int64), "label": r["id"] % 4}
    )


def _parts(cache: drt.Cache) -> list[str]:
    return sorted(p.name for p in (cache.path / "parts").iterdir())


def test_rows_become_records_in_order_and_columns_metadata(tmp_path: Path) -> None:
    cache = drt_ray.cache(_rows(600), "from-ray", root=tmp_path, metadata=["label"])
    assert len(cache) == 600 and cache.num_parts > 2
    assert [cache.get(i)["id"] for i in range(600)] == list(range(600))
    assert np.array_equal(cache.get(599)["x"], np.full(3, 599))
    table = cache.metadata
    assert table.columns == ["cache_id", "sample_id", "label", "weight"]
    assert table["label"].to_list() == [i % 4 for i in range(600)]
    assert drt.verify("from-ray", root=tmp_path, progress=False).ok
    # Every listed part, and nothing else, under parts/.
    assert _parts(cache) == [f"{j:05d}" for j in range(1, cache.num_parts)]
    balanced = table.with_columns(pl.col("label").drt.balance().alias("weight"))
    loader = balanced.drt.loader(batch_size=50, seed=0, root=tmp_path, collate=list)
    assert sum(len(batch) for batch in loader) == 600
    # The name is taken: the dataset is not run again.
    again = drt_ray.cache(_rows(10), "from-ray", root=tmp_path)
    assert again.cache_id == cache.cache_id
    # Damage in a part is reported by cache-wide sample ids, like any cache's.
    last = cache.path / "parts" / f"{cache.num_parts - 1:05d}" / "shards" / "00000.bin"
    data = bytearray(last.read_bytes())
    data[-5] ^= 0xFF  # inside the last record
    last.write_bytes(bytes(data))
    report = drt.verify("from-ray", root=tmp_path, progress=False)
    assert [p.sample_ids for p in report.problems if p.sample_ids] == [[599]]


def test_a_metadata_function_and_compression(tmp_path: Path) -> None:
    def meta(row: dict[str, Any]) -> dict[str, Any]:
        return {"even": row["id"] % 2 == 0, "weight": 1.0 + row["label"]}

    cache = drt_ray.cache(
        _rows(200, blocks=3), "packed", root=tmp_path, metadata=meta, compression="zstd"
    )
    assert cache.compression == ("zstd", 3)
    assert cache.metadata["weight"].to_list() == [1.0 + i % 4 for i in range(200)]
    assert cache.metadata["even"].to_list() == [i % 2 == 0 for i in range(200)]
    assert cache.get(123)["id"] == 123


def _die_once(marker: str) -> Any:
    """A metadata function that kills its worker process at row 150, the first time only."""

    def meta(row: dict[str, Any]) -> dict[str, Any]:
        if row["id"] == 150 and not os.path.exists(marker):
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return {"label": row["label"]}

    return meta


def test_a_task_killed_once_is_retried_and_its_first_attempt_leaves_nothing(
    tmp_path: Path,
) -> None:
    marker = str(tmp_path / "died")
    cache = drt_ray.cache(
        _rows(400, blocks=4), "retried", root=tmp_path / "caches", metadata=_die_once(marker)
    )
    assert os.path.exists(marker), "the write task was killed once"
    assert [cache.get(i)["id"] for i in range(400)] == list(range(400))
    assert cache.metadata["label"].to_list() == [i % 4 for i in range(400)]
    assert _parts(cache) == [f"{j:05d}" for j in range(1, cache.num_parts)]
    assert drt.verify("retried", root=tmp_path / "caches", progress=False).ok


def test_a_failing_job_leaves_nothing_visible(tmp_path: Path) -> None:
    def meta(row: dict[str, Any]) -> dict[str, Any]:
        if row["id"] == 77:
            raise ValueError("row 77 has no label")
        return {"label": row["label"]}

    with pytest.raises(Exception, match="row 77 has no label"):
        drt_ray.cache(_rows(200, blocks=2), "failed", root=tmp_path, metadata=meta)
    with pytest.raises(CacheNotFoundError):
        drt.open("failed", root=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if "failed" in p.name] == []


def test_arguments_are_checked_before_the_job_runs(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="ds must be a ray.data.Dataset, not list"):
        drt_ray.cache([1, 2], "bad", root=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="metadata must be a list of column names"):
        drt_ray.cache(_rows(5), "bad", root=tmp_path, metadata=3)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="compression must be None"):
        drt_ray.cache(_rows(5), "bad", root=tmp_path, compression="gzip")
    assert list(tmp_path.iterdir()) == []

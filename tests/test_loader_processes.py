"""Loaders across real processes: torch.distributed (gloo), start methods, and scale."""

from __future__ import annotations

import json
import socket
from typing import Any

import numpy as np
import polars as pl
import pytest
from helpers import python_child

import dataset_rt as drt

DDP_RANK = """
import json, os
import torch, torch.distributed as dist
import numpy as np, dataset_rt as drt

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
# Every rank asks for the cache; one builds it, the others wait and open it.
cache = drt.cache(
    ({"x": np.full(4, i), "label": i % 5} for i in range(300)),
    "ddp-cache",
    metadata=lambda r: {"label": r["label"]},
    progress=False,
)
loader = cache.metadata.drt.loader(batch_size=16, seed=3, num_samples=301)
batches = [b["x"][:, 0].tolist() for b in loader]
counts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
dist.all_gather(counts, torch.tensor([len(batches)]))
gathered = [None] * world
dist.all_gather_object(gathered, batches)
if rank == 0:
    print(json.dumps({"len": len(loader), "counts": [int(c) for c in counts],
                      "batches": gathered, "cache_id": cache.cache_id}))
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("world", [2, 3])
def test_torch_distributed_ranks_get_disjoint_equal_shares(world: int) -> None:
    port = str(_free_port())
    children = [
        python_child(
            DDP_RANK,
            env={
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in range(world)
    ]
    outputs = [c.communicate(timeout=300) for c in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err
    result = json.loads(outputs[0][0])
    assert result["counts"] == [result["len"]] * world, "ranks must step equally (DDP hangs)"
    per_rank = [[i for b in batches for i in b] for batches in result["batches"]]
    assert len({len(p) for p in per_rank}) == 1
    frame = drt.open("ddp-cache").metadata
    assert drt.open("ddp-cache").cache_id == result["cache_id"]
    stream = frame.drt.epoch(seed=3, num_samples=301)["sample_id"].to_list()
    interleaved = [per_rank[i % world][i // world] for i in range(301)]
    assert interleaved == stream, "the ranks together read the one global stream"


START_METHOD = """
import json, multiprocessing, sys
multiprocessing.set_start_method(sys.argv[1] if len(sys.argv) > 1 else "{method}", force=True)
import numpy as np, polars as pl, dataset_rt as drt

# The parent has already run a parallel Polars query and the native prefetch threads.
big = pl.DataFrame({{"k": np.arange(2_000_000) % 97, "v": np.arange(2_000_000)}})
assert big.group_by("k").agg(pl.col("v").sum()).height == 97
cache = drt.open("start-cache", root={root!r})
frame = cache.metadata.with_columns(weight=pl.col("label").drt.balance())
list(frame.drt.loader(batch_size=32, seed=1))
loader = frame.drt.loader(batch_size=32, seed=1, num_workers=2)
print(json.dumps([i for b in loader for i in b["x"][:, 0].tolist()]))
"""


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_workers_never_hang_whatever_the_start_method(method: str) -> None:
    cache = drt.cache(
        ({"x": np.full(2, i), "label": i % 4} for i in range(400)),
        "start-cache",
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )
    frame = cache.metadata.with_columns(weight=pl.col("label").drt.balance())
    reference = [i for b in frame.drt.loader(batch_size=32, seed=1) for i in b["x"][:, 0].tolist()]
    child = python_child(START_METHOD.format(method=method, root=str(cache.root)))
    out, err = child.communicate(timeout=240)
    assert child.returncode == 0, err
    assert json.loads(out) == reference


def test_weighted_sampling_far_beyond_torch_multinomial_limit() -> None:
    rows = 50_000_000
    hot = np.arange(rows - 1000, rows)  # all the weight sits beyond 2**24 rows
    weights = np.zeros(rows)
    weights[hot] = 1.0
    frame = pl.DataFrame({"weight": weights})
    counts = frame.select(pl.col("weight").drt.draws(100_000, seed=0)).to_series().to_numpy()
    assert counts.sum() == 100_000
    assert counts[: rows - 1000].sum() == 0
    drawn = np.flatnonzero(counts)
    assert len(drawn) > 900 and drawn.min() >= rows - 1000
    del frame, counts

    # And a loader over 50M rows, all pointing into one small cache.
    cache = drt.cache((i for i in range(1000)), "tiny", progress=False)
    big = pl.DataFrame(
        {
            "cache_id": pl.repeat(cache.cache_id, rows, eager=True),
            "sample_id": np.arange(rows, dtype=np.int64) % 1000,
            "weight": weights,
        }
    )
    del weights
    loader = big.drt.loader(batch_size=1000, seed=0, num_samples=5000, collate=list)
    seen: list[Any] = [i for b in loader for i in b]
    assert len(seen) == 5000
    assert set(seen) <= {int(r % 1000) for r in hot}

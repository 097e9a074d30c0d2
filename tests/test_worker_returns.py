"""Batches coming back from worker processes through their rings of reused shared buffers.

A worker fills a buffer again once the main process no longer holds any tensor over it: these
tests keep batches, views and arrays of batches across many more batches than a ring holds,
and check that what they keep still holds the samples it was given.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import Pair, as_arrays, held, transposed

import dataset_rt as drt

WIDTH = 8192  # int32s per record: 32 KiB, a 256 KiB batch of 8


def record(i: int) -> dict[str, Any]:
    return {"x": np.full(WIDTH, i, dtype=np.int32), "label": i}


@pytest.fixture
def arrays() -> drt.Cache:
    return drt.cache((record(i) for i in range(64)), "returns", progress=False)


def check(batch: dict[str, torch.Tensor]) -> None:
    """Every row of the batch's array holds its own label, all through."""
    labels = batch["label"]
    assert batch["x"].shape == (len(labels), WIDTH)
    assert torch.equal(batch["x"], labels[:, None].to(torch.int32).expand(-1, WIDTH))


def test_kept_batches_views_and_arrays_are_never_overwritten(arrays: drt.Cache) -> None:
    # 600 batches: each worker sends several times the buffers its ring may hold.
    frame = arrays.metadata
    loader = frame.drt.loader(batch_size=8, seed=3, num_samples=4800, num_workers=2)
    reference = frame.drt.loader(batch_size=8, seed=3, num_samples=4800)
    kept: list[Any] = []
    for number, (batch, expected) in enumerate(zip(loader, reference, strict=True)):
        assert torch.equal(batch["label"], expected["label"])
        check(batch)
        if number % 7 == 0:
            kept.append(batch)  # the whole batch
        elif number % 7 == 1:
            kept.append((batch["label"][2:5].clone(), batch["x"][2:5]))  # a view only
        elif number % 7 == 2:
            kept.append((batch["label"].clone(), batch["x"].numpy()))  # a NumPy array only
    for item in kept:
        if isinstance(item, dict):
            check(item)
        else:
            labels, x = item
            check({"label": labels, "x": torch.as_tensor(x)})


def test_an_epoch_held_whole_is_intact(arrays: drt.Cache) -> None:
    frame = arrays.metadata
    # Past the rings' room, batches travel PyTorch's way: list() keeps all 300 of them.
    batches = list(frame.drt.loader(batch_size=4, seed=1, num_samples=1200, num_workers=2))
    assert len(batches) == 300
    for batch in batches:
        check(batch)


def test_any_collate_output_arrives_as_without_workers(arrays: drt.Cache) -> None:
    frame = arrays.metadata
    options: dict[str, Any] = {"batch_size": 8, "seed": 5, "num_samples": 2400}
    kept = []
    for got, want in zip(
        frame.drt.loader(**options, collate=transposed, num_workers=1),
        frame.drt.loader(**options, collate=transposed),
        strict=True,
    ):
        pair, extra, (as_float, as_array) = got
        assert isinstance(pair, Pair)
        assert torch.equal(pair.x, want[0].x) and not pair.x.is_contiguous()
        assert torch.equal(pair.label, want[0].label)
        assert torch.equal(extra["tail"], want[1]["tail"]) and extra["name"] == "b"
        assert torch.equal(extra["doubled"], want[1]["doubled"])
        assert as_float.dtype == torch.float64 and torch.equal(as_float, want[2][0])
        assert np.array_equal(as_array, want[2][1])
        kept.append((pair.x, want[0].x.clone()))
    for x, want_x in kept:
        assert torch.equal(x, want_x)


def test_objects_that_hide_tensors_keep_their_batches(arrays: drt.Cache) -> None:
    frame = arrays.metadata
    holders = list(
        frame.drt.loader(batch_size=8, seed=2, num_samples=1600, collate=held, num_workers=2)
    )
    assert len(holders) == 200
    for holder in holders:
        check(holder.batch)


def test_arrays_over_a_batch_buffer_arrive_whole(arrays: drt.Cache) -> None:
    # The array is pickled after the worker has moved on to its next batches.
    frame = arrays.metadata
    options: dict[str, Any] = {"batch_size": 8, "seed": 6, "num_samples": 2400}
    for got, want in zip(
        frame.drt.loader(**options, collate=as_arrays, num_workers=2),
        frame.drt.loader(**options),
        strict=True,
    ):
        assert isinstance(got["x"], np.ndarray)
        assert np.array_equal(got["x"], want["x"].numpy())

"""Fixtures shared by the test modules (the root conftest isolates DATASET_RT_HOME)."""

from __future__ import annotations

import pytest
from helpers import record

import dataset_rt as drt


@pytest.fixture
def small() -> drt.Cache:
    """A 200-record cache over many small shards, with a label column."""
    return drt.cache(
        [record(i) for i in range(200)],
        "small",
        metadata=lambda r: {"label": r["label"]},
        shard_size=4096,
        progress=False,
    )

"""Every test and doctest gets its own empty DATASET_RT_HOME, so nothing touches ~/.cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Charts in the docs and tests render off-screen.
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "dataset_rt_home"
    monkeypatch.setenv("DATASET_RT_HOME", str(home))
    return home

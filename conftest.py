"""Every test and doctest gets its own empty DATASET_RT_HOME, so nothing touches ~/.cache.

The suite tests the installed package (a wheel, or an editable install): pytest runs in
importlib mode, which leaves sys.path alone, and takes a doctest's module from sys.modules
when it is there. Importing every module of the installed package here makes the doctests
of dataset_rt/ run against what pip installed rather than against the checkout.

The checkout's own dataset_rt/ (without the compiled module) sits in the repository root, so
the session runs in a scratch directory: a child interpreter started with ``python -c`` or
``python -m``, or a Ray worker, puts its working directory first on sys.path.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import dataset_rt

for _module in pkgutil.walk_packages(dataset_rt.__path__, "dataset_rt."):
    if not _module.name.endswith("__main__"):
        importlib.import_module(_module.name)

# Charts in the docs and tests render off-screen.
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True, scope="session")
def _away_from_the_checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    here = Path.cwd()
    scratch = tmp_path_factory.mktemp("cwd")
    os.chdir(scratch)
    try:
        yield scratch
    finally:
        os.chdir(here)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "dataset_rt_home"
    monkeypatch.setenv("DATASET_RT_HOME", str(home))
    return home

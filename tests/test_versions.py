"""The supported Polars range: one statement of it, silence inside it, clear words outside."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import polars as pl
import pytest

from dataset_rt._version_check import (
    POLARS_CEILING,
    POLARS_FLOOR,
    POLARS_REQUIREMENT,
    _release,
    check_polars_version,
)

REPO = Path(__file__).resolve().parent.parent


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def test_pyproject_states_the_range_the_import_check_enforces() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    (polars,) = re.findall(r'"(polars[^"]*)"', pyproject.split("dependencies = [", 1)[1][:200])
    assert polars == POLARS_REQUIREMENT
    assert f"polars>={_dotted(POLARS_FLOOR)},<{_dotted(POLARS_CEILING)}" == POLARS_REQUIREMENT


def test_python_requirement_and_classifiers_name_3_10_to_3_13() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.10"' in pyproject
    for minor in ("3.10", "3.11", "3.12", "3.13"):
        assert f'"Programming Language :: Python :: {minor}"' in pyproject


def test_the_installed_polars_is_inside_the_range() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_polars_version()


@pytest.mark.parametrize(
    "version", [_dotted(POLARS_FLOOR) + ".0", "1.44.2", "2.0.0", "2.1.0", "2.1.0rc1", "2.99.3"]
)
def test_versions_inside_the_range_pass_silently(version: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_polars_version(version)


@pytest.mark.parametrize("version", ["0.20.31", f"{POLARS_FLOOR[0]}.{POLARS_FLOOR[1] - 1}.9"])
def test_an_older_polars_is_refused_with_the_versions_that_work(version: str) -> None:
    with pytest.raises(ImportError, match=re.escape(f"needs {POLARS_REQUIREMENT}")) as caught:
        check_polars_version(version)
    assert f"polars {version} is installed" in str(caught.value)


@pytest.mark.parametrize("version", ["3.0.0", "3.0.0b1", "4.1.0"])
def test_a_later_major_line_warns_with_the_tested_range(version: str) -> None:
    with pytest.warns(RuntimeWarning, match=re.escape(f"tested with {POLARS_REQUIREMENT}")):
        check_polars_version(version)


@pytest.mark.skipif("DATASET_RT_TEST_POLARS" not in os.environ, reason="set by scripts/test.sh")
def test_this_run_is_on_the_polars_of_its_end_of_the_range() -> None:
    # scripts/test.sh runs the suite on Python 3.10 with the floor and on Python 3.13 with
    # the newest release; the floor end must really have the floor installed (pip would
    # otherwise be free to pick a later one).
    expected = os.environ["DATASET_RT_TEST_POLARS"]
    assert _release(pl.__version__)[: len(_release(expected))] == _release(expected)


@pytest.mark.skipif(
    "DATASET_RT_TEST_INSTALLED" not in os.environ, reason="scripts/test.sh tests installed wheels"
)
def test_this_run_imports_the_installed_wheel_not_the_checkout() -> None:
    import dataset_rt

    assert not Path(dataset_rt.__file__).resolve().is_relative_to(REPO / "dataset_rt")
    assert "site-packages" in Path(dataset_rt.__file__).parts

"""The Polars versions dataset_rt works with, checked when ``dataset_rt`` is imported."""

from __future__ import annotations

import re
import warnings

import polars as pl

# The expression plugins are compiled against the polars 0.55 crates (Python Polars 2.1) and
# reach Polars through its plugin interface: Series cross it by the Arrow C data interface,
# which has stayed compatible since the floor. The floor is the lowest release the test suite
# passes on; see docs/install.md for what sets it. pyproject.toml states the same range
# (a test holds the two together).
POLARS_FLOOR = (1, 25)
POLARS_CEILING = (3,)
POLARS_REQUIREMENT = "polars>=1.25,<3"


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: ``"2.1.0rc1"`` -> ``(2, 1, 0)``."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


POLARS_2 = _release(pl.__version__) >= (2,)
"""Whether the installed Polars is of the 2.x line (Python scan sources in every engine,
grouping by fixed-size arrays); the modules that behave differently read this."""

CACHE_ID_DTYPE: pl.DataType = pl.Categorical() if POLARS_2 else pl.String()
"""The dtype of ``cache_id`` in every frame dataset_rt gives users (metadata tables, ``seen``,
``list_caches``): a categorical where Polars' categories are global (Polars 2), 4 bytes a row
instead of a string's 16 or more, and frames of several caches still concatenate and join
without re-encoding. Before Polars 2 a categorical is local to its frame (joining two re-maps
them, with a warning), so there it stays a string."""


def check_polars_version(version: str | None = None) -> None:
    """Checks the installed Polars (or ``version``) against the supported range.

    Raises
    ------
    ImportError
        For a Polars older than the floor: its plugin interface or the APIs dataset_rt uses
        are missing there, and the expressions would fail or crash.

    Warns
    -----
    RuntimeWarning
        For a Polars from a later major line than any dataset_rt was tested with.
    """
    found = version if version is not None else pl.__version__
    release = _release(found)
    if release < POLARS_FLOOR:
        raise ImportError(
            f"dataset_rt needs {POLARS_REQUIREMENT}, but polars {found} is installed. "
            f"Upgrade it: pip install '{POLARS_REQUIREMENT}'"
        )
    if release >= POLARS_CEILING:
        warnings.warn(
            f"dataset_rt is tested with {POLARS_REQUIREMENT}, but polars {found} is installed; "
            f"the .drt expressions may fail. If they do, install '{POLARS_REQUIREMENT}'.",
            RuntimeWarning,
            stacklevel=3,
        )

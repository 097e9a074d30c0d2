"""The Polars versions the expression plugins were built and tested against."""

from __future__ import annotations

import warnings

import polars as pl

# The plugin is compiled against the polars 0.55 crates, the line Python Polars 2.1 ships.
# Keep in step with the `polars` requirement in pyproject.toml.
SUPPORTED_POLARS = ((2, 1), (2, 2))


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_polars_version() -> None:
    """Warns when the installed Polars lies outside the range the plugins were built for."""
    low, high = SUPPORTED_POLARS
    found = _version_tuple(pl.__version__)
    if not low <= found < high:
        warnings.warn(
            f"dataset_rt's expression plugins are built for polars >={low[0]}.{low[1]},"
            f"<{high[0]}.{high[1]} but polars {pl.__version__} is installed; the .drt "
            "expressions may fail or crash. Install a supported polars version.",
            RuntimeWarning,
            stacklevel=3,
        )

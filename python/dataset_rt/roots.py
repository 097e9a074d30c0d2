"""Where caches live: the root directory a call works in."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PathLike", "default_root", "resolve_root"]

PathLike = str | os.PathLike[str]


def default_root() -> Path:
    """``$DATASET_RT_HOME`` if set, else ``~/.cache/dataset_rt``."""
    env = os.environ.get("DATASET_RT_HOME")
    if env:
        return Path(env).expanduser().absolute()
    return (Path.home() / ".cache" / "dataset_rt").absolute()


def resolve_root(root: PathLike | None) -> Path:
    """The root directory a call works in: ``root`` if given, else :func:`default_root`."""
    return default_root() if root is None else Path(root).expanduser().absolute()

"""Where caches live: the root directory a call works in."""

from __future__ import annotations

import os
from pathlib import Path

from dataset_rt.errors import ArgumentError

__all__ = [
    "PathLike",
    "default_root",
    "is_url",
    "local_dir",
    "resolve_root",
    "root_url",
]

PathLike = str | os.PathLike[str]

_SCHEMES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure", "file"}


def is_url(root: object) -> bool:
    """Whether ``root`` names object storage (``s3://...`` and the like), not a directory."""
    if not isinstance(root, str) or ":" not in root:
        return False  # no scheme: a directory, and urllib.parse (with ipaddress) stays unimported
    from urllib.parse import urlparse

    return urlparse(root).scheme in _SCHEMES


def root_url(root: PathLike | None) -> str | None:
    """The object-storage URL a call works in, or None for a directory.

    That is ``root``, or without one ``$DATASET_RT_HOME``, if it is a URL.
    """
    if root is None:
        root = os.environ.get("DATASET_RT_HOME") or None
    return root if isinstance(root, str) and is_url(root) else None


def _home() -> Path:
    env = os.environ.get("DATASET_RT_HOME")
    if env and not is_url(env):
        return Path(env).expanduser().absolute()
    return (Path.home() / ".cache" / "dataset_rt").absolute()


def local_dir(local: PathLike | None = None) -> Path:
    """Where remote caches' files are kept on this machine.

    ``local`` if given, else ``$DATASET_RT_LOCAL_DIR``, else ``.remote`` under the local
    root (``$DATASET_RT_HOME`` when that is a directory, else ``~/.cache/dataset_rt``).
    """
    if local is not None:
        return Path(local).expanduser().absolute()
    env = os.environ.get("DATASET_RT_LOCAL_DIR")
    if env:
        return Path(env).expanduser().absolute()
    return _home() / ".remote"


def default_root() -> Path:
    """``$DATASET_RT_HOME`` if set, else ``~/.cache/dataset_rt``.

    Raises
    ------
    ArgumentError
        ``$DATASET_RT_HOME`` is an object-storage URL: the caller works on local caches only.
    """
    url = root_url(None)
    if url is not None:
        raise ArgumentError(
            f"DATASET_RT_HOME is {url}, in object storage, but this works on a local "
            "directory; pass root= a directory"
        )
    return _home()


def resolve_root(root: PathLike | None) -> Path:
    """The root directory a call works in: ``root`` if given, else :func:`default_root`.

    Raises
    ------
    ArgumentError
        The root is an object-storage URL: the caller works on local caches only.
    """
    if root is None:
        return default_root()
    if is_url(root):
        raise ArgumentError(
            f"root {root!r} is in object storage, but this works on a local directory; "
            "copy the cache with dataset_rt.remote.pull first"
        )
    return Path(root).expanduser().absolute()

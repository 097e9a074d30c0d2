"""Finding the cache behind a ``cache_id``, for frames that carry only ids.

A metadata frame knows each row's ``(cache_id, sample_id)`` but not where the cache lives.
Every cache opened or built in this process is remembered by id; other ids are looked up
among the caches under the given root, the roots seen so far and the default root.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from dataset_rt import _native
from dataset_rt.errors import CacheCorruptError, CacheNotFoundError

if TYPE_CHECKING:
    from dataset_rt.cache import Cache, PathLike

__all__ = ["find", "remember"]

_lock = threading.Lock()
_places: dict[str, tuple[Path, str]] = {}  # cache_id -> (root, name)
_roots: dict[Path, None] = {}  # roots seen, in order


def remember(cache: Cache) -> None:
    """Records where the cache with this id lives."""
    with _lock:
        _places[cache.cache_id] = (cache.root, cache.name)
        _roots.setdefault(cache.root)


def _search(cache_id: str, roots: Iterable[Path]) -> tuple[Path, str] | None:
    for root in roots:
        store = _native.Store(str(root))
        for name in store.names():
            try:
                manifest = json.loads(store.manifest_json(name))
            except (CacheCorruptError, CacheNotFoundError):
                continue
            if manifest.get("cache_id") == cache_id:
                return root, name
    return None


def find(cache_id: str, root: PathLike | None = None) -> Cache:
    """Opens the cache whose build has id ``cache_id``.

    Raises
    ------
    CacheNotFoundError
        No cache with this id exists where it was seen, nor under ``root``, the roots used
        so far in this process, or the default root. A cache rebuilt under its old name has
        a new id, so frames of the old build fail here instead of reading the wrong bytes.
    """
    from dataset_rt.cache import Cache, default_root, resolve_root

    with _lock:
        known = _places.get(cache_id)
        roots = list(_roots)
    candidates: list[tuple[Path, str]] = [known] if known else []
    for root_path, name in candidates:
        try:
            reader = _native.Store(str(root_path)).open(name)
        except CacheNotFoundError:
            continue
        if json.loads(reader.manifest_json)["cache_id"] == cache_id:
            return Cache(reader, root_path)
    search_roots = [resolve_root(root)] if root is not None else [*roots, default_root()]
    found = _search(cache_id, dict.fromkeys(search_roots))
    if found is None:
        where = ", ".join(str(r) for r in dict.fromkeys(search_roots))
        raise CacheNotFoundError(
            f"no cache with cache_id {cache_id!r} under {where}; it was rebuilt or deleted, "
            "or lives under another root (pass root=)"
        )
    root_path, name = found
    return Cache(_native.Store(str(root_path)).open(name), root_path)

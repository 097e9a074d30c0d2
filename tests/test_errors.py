"""Which exception a failure becomes: the caller's mistakes, damage, and dataset_rt's own bugs."""

from __future__ import annotations

from pathlib import Path

import pytest

import dataset_rt as drt
from dataset_rt import _native
from dataset_rt.errors import DatasetRTError, InternalError


def test_a_broken_invariant_is_an_internal_error_that_asks_for_a_report(tmp_path: Path) -> None:
    # The package never saves through a released lock; doing it by hand breaks the
    # invariant the save relies on, which is dataset_rt's bug, not an argument error.
    cache = drt.cache(range(3), "internal", root=tmp_path, progress=False)
    store = _native.Store(str(tmp_path))
    lock = store.lock("internal")
    lock.release()
    with pytest.raises(InternalError, match="please report it") as caught:
        store.save_metadata(lock, cache.cache_id)
    assert "the build lock was already released" in str(caught.value)
    assert isinstance(caught.value, DatasetRTError) and isinstance(caught.value, RuntimeError)


class _Stop(Exception):
    pass


def test_an_exception_from_a_progress_callback_reaches_the_caller_as_itself(
    tmp_path: Path,
) -> None:
    drt.cache([bytes(100)] * 50, "callback", root=tmp_path, progress=False)
    calls: list[int] = []

    def progress(nbytes: int) -> None:
        calls.append(nbytes)
        raise _Stop("stop checking")

    with pytest.raises(_Stop, match="stop checking"):
        _native.Store(str(tmp_path)).verify("callback", progress)
    assert len(calls) == 1

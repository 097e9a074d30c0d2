"""Starting child processes without plain ``fork`` and without re-running ``__main__``.

A child forked from a process whose Polars thread pool has run can deadlock, so children
start from a ``forkserver`` or by ``spawn``. ``multiprocessing`` normally re-executes a
script's ``__main__`` in every child it does not fork from the parent; a script without an
``if __name__ == "__main__":`` guard would then build caches, start processes or join a
``torch.distributed`` group in each child. The contexts here launch children that leave the
main module alone: what they need travels with cloudpickle (by value for objects of
``__main__``). Loader workers (``workers``) and parallel builds (``build``) start this way.
"""

from __future__ import annotations

import contextlib
import multiprocessing.context
import multiprocessing.popen_forkserver
import multiprocessing.popen_spawn_posix
import multiprocessing.spawn
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["ForkServerContext", "SpawnContext"]

_launching = threading.Lock()


@contextlib.contextmanager
def _main_module_left_alone() -> Iterator[None]:
    """While a process is launched, tell it not to import the parent's ``__main__``.

    ``multiprocessing`` has no switch for this: the data a new process prepares itself from
    comes from ``spawn.get_preparation_data``, which both start methods call by module
    attribute. It is replaced only for the duration of one launch, under a lock, and only
    for the launching thread.
    """
    with _launching:
        original = multiprocessing.spawn.get_preparation_data
        launcher = threading.get_ident()

        def without_main(name: str) -> dict[str, Any]:
            data: dict[str, Any] = original(name)
            # Another thread starting a process of its own meanwhile gets what it asked for.
            if threading.get_ident() == launcher:
                data.pop("init_main_from_name", None)
                data.pop("init_main_from_path", None)
            return data

        multiprocessing.spawn.get_preparation_data = without_main
        try:
            yield
        finally:
            multiprocessing.spawn.get_preparation_data = original


class _MainModuleLeftAlone:
    """Mixed into a start method's ``Popen``: its launch leaves the main module alone."""

    def _launch(self, process_obj: Any) -> None:
        with _main_module_left_alone():
            super()._launch(process_obj)  # type: ignore[misc]  # the Popen it is mixed into


class _ForkServerPopen(_MainModuleLeftAlone, multiprocessing.popen_forkserver.Popen):
    pass


class _SpawnPopen(_MainModuleLeftAlone, multiprocessing.popen_spawn_posix.Popen):
    pass


class _ForkServerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _ForkServerPopen(process_obj)


class _SpawnProcess(multiprocessing.context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _SpawnPopen(process_obj)


class ForkServerContext(multiprocessing.context.ForkServerContext):
    """A ``forkserver`` context whose processes leave the main module alone."""

    Process = _ForkServerProcess


class SpawnContext(multiprocessing.context.SpawnContext):
    """A ``spawn`` context whose processes leave the main module alone."""

    Process = _SpawnProcess

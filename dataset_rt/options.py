"""A loader's options, checked: the draws, the ranks and the numbers every loader takes."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from dataset_rt.errors import ArgumentError, LoaderStateError
from dataset_rt.program import Phase, check_phases

__all__ = ["check_draws", "check_int", "check_same", "resolve_ranks"]


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an int in ``[minimum, maximum]``; an ``ArgumentError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"at least {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ArgumentError(f"{name} must be {bound}, got {value}")
    return value


def check_draws(
    shuffle: bool, num_samples: object, schedule: Sequence[Phase] | None, num_workers: int
) -> tuple[int | None, list[Phase] | None]:
    """Checks the options every loader takes about its draws: ``(num_samples, phases)``."""
    if num_samples is not None:
        if not shuffle:
            raise ArgumentError(
                "num_samples applies to shuffled loaders; shuffle=False reads every row once"
            )
        num_samples = check_int("num_samples", num_samples, 1)
    phases = None if schedule is None else check_phases(schedule)
    if phases is not None and not shuffle:
        raise ArgumentError("schedule= sets the weights of draws; it needs shuffle=True")
    if num_workers > 0:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ArgumentError(
                "num_workers > 0 runs PyTorch DataLoader workers: pip install torch, "
                "or use num_workers=0"
            ) from None
    return num_samples, phases


def _distributed() -> tuple[int, int] | None:
    # A process group can only be initialised once torch is imported: never import it here
    # just to find out (that alone takes over a second).
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` as given, else from ``torch.distributed``, else ``(0, 1)``."""
    if rank is None and world_size is None:
        return _distributed() or (0, 1)
    if rank is None or world_size is None:
        raise ArgumentError("pass both rank and world_size, or neither")
    world_size = check_int("world_size", world_size, 1)
    return check_int("rank", rank, 0, world_size - 1), world_size


def check_same(state: Mapping[str, object], mine: Mapping[str, object]) -> None:
    """Refuses a loader state whose settings differ from this loader's (``mine``)."""
    for key, value in mine.items():
        if state.get(key) != value:
            raise LoaderStateError(
                f"the state's {key} is {state.get(key)!r} but this loader's is {value!r}: "
                "it was saved by a loader over other rows, weights or settings"
            )

"""How batches come back from the loader's worker processes: a ring of reused shared buffers.

PyTorch sends a tensor from a DataLoader worker to the main process through shared memory:
a tensor not yet shared is copied into a new segment, and each segment's file descriptor
travels over a socket, to be mapped afresh by the main process. For a batch of large
arrays every page of every batch is then faulted in twice, once by the worker writing it and
once by the main process reading it, and a loader with workers ran at a fraction of one
without them.

Here each worker keeps a ring of shared segments instead, and the main process maps each
segment once. The worker stacks a batch's arrays straight into a free segment of its ring
(:func:`WorkerRing.tensor`, used by :mod:`dataset_rt.collate`), and before the batch is
sent, :meth:`WorkerRing.pack` replaces each tensor over a segment with a small marker, and
each small tensor with its bytes. The main process (:meth:`MainRing.unpack`) turns the
markers back into tensors over its own mapping of the segment. A segment is lent to one
batch at a time: a byte per segment in memory shared by both sides says whether the main
process still holds any tensor over it. The main process clears that byte when the last
tensor (or view, or NumPy array) over the batch's memory is gone, so a batch a user keeps is
never overwritten; the worker only fills segments whose byte is clear, and sends a batch the
way PyTorch does when its ring is full.

What the markers cannot see into (an object of the user's own collate that holds tensors)
goes PyTorch's way unchanged, and the segments lent to that batch leave the ring for good.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["MainRing", "WorkerRing", "set_worker_ring", "worker_ring"]

SLOTS = 64
"""Segments a worker's ring may hold (and may ever have retired)."""

MAX_BYTES = 512 << 20
"""Bytes of segments a worker's ring may hold; past it, batches go PyTorch's way."""

INLINE_BELOW = 64 << 10
"""Tensors smaller than this travel as bytes in the batch's message, not shared memory."""

_ROUND = 4096

# Values that a batch may hold and that cannot hide a tensor.
_ATOMS = (str, bytes, int, float, complex, bool, type(None), np.generic)


@dataclass(frozen=True, slots=True)
class _InRing:
    """A tensor over segment ``slot`` of worker ``worker``'s ring, in the message."""

    worker: int
    slot: int
    generation: int
    segment: torch.Tensor | None  # sent with the segment's first batch only
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True, slots=True)
class _Inline:
    """A small tensor's bytes, in the message."""

    data: bytes
    dtype: torch.dtype
    size: tuple[int, ...]


class _Opaque(Exception):
    """The batch holds an object whose tensors a marker cannot replace."""


class _Segment:
    __slots__ = ("generation", "index", "memory", "nbytes", "pointer", "sent")

    def __init__(self, index: int, generation: int, nbytes: int) -> None:
        self.index = index
        self.generation = generation
        self.nbytes = nbytes
        self.memory = torch.empty(0, dtype=torch.uint8)
        storage = self.memory._typed_storage()._new_shared(nbytes, device="cpu")  # type: ignore[no-untyped-call]
        self.memory = self.memory.new(storage)
        self.pointer = self.memory.untyped_storage().data_ptr()
        self.sent = False


class WorkerRing:
    """A worker's segments, and which of them the main process still holds."""

    def __init__(self, flags: torch.Tensor, worker: int) -> None:
        self._worker = worker
        self._busy: np.ndarray[Any, np.dtype[np.uint8]] = flags.numpy()[worker]
        self._segments: dict[int, _Segment] = {}
        self._retired: set[int] = set()
        self._lent: list[_Segment] = []
        self._generations = 0

    def tensor(self, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized tensor over a free segment, or ``None`` if the ring is full."""
        nbytes = math.prod(size) * dtype.itemsize
        if nbytes == 0:
            return None
        segment = self._free(nbytes)
        if segment is None:
            return None
        self._busy[segment.index] = 1
        self._lent.append(segment)
        return segment.memory[:nbytes].view(dtype).view(size)

    def _free(self, nbytes: int) -> _Segment | None:
        free = [s for s in self._segments.values() if not self._busy[s.index]]
        fits = [s for s in free if s.nbytes >= nbytes]
        if fits:
            return min(fits, key=lambda s: s.nbytes)
        rounded = -(-nbytes // _ROUND) * _ROUND
        held = sum(s.nbytes for s in self._segments.values())
        unused = next(
            (i for i in range(SLOTS) if i not in self._segments and i not in self._retired), None
        )
        if unused is not None and held + rounded <= MAX_BYTES:
            return self._new(unused, rounded)
        # A free segment too small for this batch makes room for one that is large enough.
        spare = next(iter(free), None)
        if spare is not None and held - spare.nbytes + rounded <= MAX_BYTES:
            return self._new(spare.index, rounded)
        return None

    def _new(self, index: int, nbytes: int) -> _Segment | None:
        """A new segment at ``index``, or ``None`` where shared memory is short.

        A small ``/dev/shm``, as in a container: the batch then goes PyTorch's way.
        """
        self._generations += 1
        try:
            segment = _Segment(index, self._generations, nbytes)
        except (RuntimeError, OSError):
            return None
        self._segments[index] = segment
        return segment

    def pack(self, batch: Any) -> Any:
        """``batch`` as the message to send: tensors over segments and small ones replaced."""
        held: set[int] = set()
        try:
            message = self._pack(batch, held)
        except _Opaque:
            message = batch
            # Whatever was lent to this batch may reach the main process inside the opaque
            # object, where no marker says when it is free again: it leaves the ring.
            for segment in self._lent:
                self._segments.pop(segment.index, None)
                self._retired.add(segment.index)
            held = set()
        for segment in self._lent:
            if segment.index not in held and segment.index not in self._retired:
                self._busy[segment.index] = 0  # the batch does not hold it after all
        self._lent = []
        return message

    def _pack(self, value: Any, held: set[int]) -> Any:
        return _rebuilt(value, lambda leaf: self._pack_leaf(leaf, held))

    def _pack_leaf(self, value: Any, held: set[int]) -> Any:
        if type(value) is torch.Tensor:
            return self._pack_tensor(value, held)
        if isinstance(value, _ATOMS):
            return value
        if isinstance(value, np.ndarray) and not value.dtype.hasobject:
            # Pickled by value, but later, on the queue's feeder thread: an array over a
            # segment that no marker holds (which the next batch may fill) is copied now.
            start = value.__array_interface__["data"][0]
            if any(s.pointer <= start < s.pointer + s.nbytes for s in self._lent):
                return value.copy()
            return value
        raise _Opaque

    def _pack_tensor(self, tensor: torch.Tensor, held: set[int]) -> Any:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.requires_grad:
            raise _Opaque
        pointer = tensor.untyped_storage().data_ptr()
        segment = next((s for s in self._lent if s.pointer == pointer), None)
        if segment is None:
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.is_shared() or tensor.is_conj() or tensor.is_neg():  # type: ignore[no-untyped-call]
                return tensor
            if nbytes < INLINE_BELOW:
                try:
                    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                except (RuntimeError, TypeError):  # a dtype without plain bytes: PyTorch's way
                    return tensor
                return _Inline(data, tensor.dtype, tuple(tensor.shape))
            copy = self.tensor(tuple(tensor.shape), tensor.dtype)
            if copy is None:
                return tensor
            copy.copy_(tensor)
            tensor, segment = copy, self._lent[-1]
        held.add(segment.index)
        first = not segment.sent
        segment.sent = True
        return _InRing(
            self._worker,
            segment.index,
            segment.generation,
            segment.memory if first else None,
            tensor.dtype,
            tuple(tensor.shape),
            tensor.stride(),
            int(tensor.storage_offset()),
        )


def _rebuilt(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with its leaves replaced by ``leaf(item)`` and its containers rebuilt.

    The containers are those a collate builds: dicts, lists, tuples and named tuples.
    """
    kind = type(value)
    if kind is dict:
        return {key: _rebuilt(item, leaf) for key, item in value.items()}
    if kind is list:
        return [_rebuilt(item, leaf) for item in value]
    if kind is tuple:
        return tuple(_rebuilt(item, leaf) for item in value)
    if issubclass(kind, tuple) and hasattr(value, "_fields"):  # a named tuple
        return kind(*(_rebuilt(item, leaf) for item in value))
    return leaf(value)


def _release(busy: np.ndarray[Any, Any], worker: int, slot: int) -> None:
    busy[worker, slot] = 0


class MainRing:
    """The main process's side: the segments seen so far, and the flags it clears."""

    def __init__(self, num_workers: int) -> None:
        flags = torch.zeros((num_workers, SLOTS), dtype=torch.uint8)
        self.flags = flags.share_memory_()  # type: ignore[no-untyped-call]
        self._busy = self.flags.numpy()
        self._segments: dict[tuple[int, int], tuple[int, np.ndarray[Any, Any]]] = {}

    def unpack(self, message: Any) -> Any:
        """The batch that ``message`` (from :meth:`WorkerRing.pack`) stands for."""
        owners: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
        return _rebuilt(message, lambda leaf: self._unpack_leaf(leaf, owners))

    def _unpack_leaf(self, value: Any, owners: dict[tuple[int, int], np.ndarray[Any, Any]]) -> Any:
        if type(value) is _InRing:
            return self._tensor(value, owners)
        if type(value) is _Inline:
            out = torch.empty(value.size, dtype=value.dtype)
            if value.data:
                view = out.reshape(-1).view(torch.uint8).numpy()
                view[:] = np.frombuffer(value.data, dtype=np.uint8)
            return out
        return value

    def _tensor(
        self, marker: _InRing, owners: dict[tuple[int, int], np.ndarray[Any, Any]]
    ) -> torch.Tensor:
        key = (marker.worker, marker.slot)
        if marker.segment is not None:
            self._segments[key] = (marker.generation, marker.segment.numpy())
        owner = owners.get(key)
        if owner is None:
            generation, memory = self._segments[key]
            if generation != marker.generation:
                raise RuntimeError(
                    f"worker {marker.worker} sent segment {marker.slot} generation "
                    f"{marker.generation} before its memory (generation {generation} seen)"
                )
            # Every tensor of this batch over the segment holds ``owner`` (through the
            # storage torch.from_numpy keeps it in); once the last is gone, so is the owner,
            # and the worker may fill the segment again.
            owner = memory.view()
            weakref.finalize(owner, _release, self._busy, marker.worker, marker.slot)
            owners[key] = owner
        base = torch.from_numpy(owner).view(marker.dtype)
        return base.as_strided(marker.size, marker.stride, marker.offset)


_worker_ring: WorkerRing | None = None


def set_worker_ring(ring: WorkerRing | None) -> None:
    """Makes ``ring`` the one this worker process's collate stacks batches into."""
    global _worker_ring
    _worker_ring = ring


def worker_ring() -> WorkerRing | None:
    """The ring of the worker process this runs in, or ``None`` outside a loader's worker."""
    return _worker_ring

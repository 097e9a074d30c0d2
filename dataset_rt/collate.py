"""The loaders' default collate: PyTorch's ``default_collate``, copying read-only arrays once.

Records decoded from the default serializer hold read-only NumPy arrays that view the
mapped shard or the loader's batch buffer. PyTorch's own collate would wrap each with
``torch.as_tensor``, which warns that the array is not writable, and then copy it into the
batch. Here the arrays are stacked straight into the batch tensor instead — the one copy a
batch needs. In a loader's worker process the batch is built in a segment of the worker's
return ring (:mod:`dataset_rt.ring`), whose memory the main process has mapped already;
tensors are stacked there too. Everything else (dicts, tuples, numbers, strings) is collated
by PyTorch unchanged.

This module needs PyTorch; the loader imports it only when PyTorch is installed.
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch.utils.data._utils.collate import collate as _collate
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

from dataset_rt.ring import worker_ring

__all__ = ["default_collate"]


class _BatchMemory:
    """Memory of dropped batch tensors, kept for the next batches of the same size.

    A batch of large arrays is tens of MiB: above glibc's mmap threshold, so each fresh
    ``torch.empty`` is a new mapping and the stacking copy page-faults on every 4 KiB page.
    Tensors built here hold a NumPy array over a pooled anonymous ``mmap``; once the last
    tensor sharing that memory is gone, the array is collected and the memory returns to the
    pool. At most ``KEEP`` free buffers of ``MAX_BYTES`` together are kept. The memory comes
    from ``mmap`` rather than ``malloc`` so that holding it leaves glibc's allocation
    heuristics (and so the speed of every other allocation in the process) alone.
    """

    KEEP = 4
    MAX_BYTES = 512 << 20

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def tensor(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` and ``dtype`` on pooled memory."""
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            # The most recently freed buffer of this size: its pages are the likeliest to
            # be in the CPU's caches, and a steady loop cycles through the fewest buffers
            # (taking the oldest would rotate through every free one, leftovers of earlier
            # loaders included).
            index = next(
                (i for i in reversed(range(len(self._free))) if len(self._free[i]) == nbytes),
                None,
            )
            memory = self._free.pop(index) if index is not None else None
        if memory is None:
            memory = mmap.mmap(-1, nbytes)
        array = np.frombuffer(memory, dtype=dtype).reshape(shape)
        # The tensor's storage keeps ``array`` alive; ``array`` keeps ``memory`` alive. Only
        # torch views are ever taken of it, so nothing else can outlive ``array``.
        weakref.finalize(array, self._put, memory)
        return torch.from_numpy(array)

    def _put(self, memory: mmap.mmap) -> None:
        with self._lock:
            held = sum(len(b) for b in self._free)
            if len(self._free) < self.KEEP and held + len(memory) <= self.MAX_BYTES:
                self._free.append(memory)


_POOL = _BatchMemory()

# Below this a fresh allocation is cheap (glibc serves it from the heap).
_POOLED_FROM = 1 << 20


def _stack_arrays(batch: list[np.ndarray[Any, Any]], *, collate_fn_map: Any = None) -> Any:
    first = batch[0]
    if first.dtype.kind not in "biufc":  # strings, objects, datetimes: PyTorch's rules
        return default_collate_fn_map[np.ndarray](batch, collate_fn_map=collate_fn_map)
    template = torch.from_numpy(np.empty(0, dtype=first.dtype))
    shape = (len(batch), *first.shape)
    ring = worker_ring()
    ringed = ring.tensor(shape, template.dtype) if ring is not None else None
    if ringed is not None:
        out = ringed
    elif torch.utils.data.get_worker_info() is not None:
        # In a worker the batch goes to the main process: build it in shared memory, so
        # that crossing over is a handle, not another copy.
        storage = template._typed_storage()._new_shared(  # type: ignore[no-untyped-call]
            math.prod(shape), device="cpu"
        )
        out = template.new(storage).resize_(shape)
    elif math.prod(shape) * first.dtype.itemsize >= _POOLED_FROM and not any(
        a.flags.writeable for a in batch
    ):
        # Only for read-only arrays, which view a shard or a batch buffer: where records own
        # their arrays (in-band pickles, custom decoders), freeing a malloc'ed batch tensor
        # is what raises glibc's mmap threshold above the arrays' size, so that each array
        # is not a fresh mapping.
        out = _POOL.tensor(shape, first.dtype)
    else:
        out = torch.empty(shape, dtype=template.dtype)
    np.stack(batch, out=out.numpy())
    return out


def _stack_tensors(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
    first = batch[0]
    ring = worker_ring()
    plain = first.device.type == "cpu" and first.layout == torch.strided and not first.is_nested
    if ring is not None and plain and all(t.shape == first.shape for t in batch):
        out = ring.tensor((len(batch), *first.shape), first.dtype)
        if out is not None:
            return torch.stack(batch, 0, out=out)
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_MAP: dict[type | tuple[type, ...], Callable[..., Any]] = {
    **default_collate_fn_map,
    np.ndarray: _stack_arrays,
    torch.Tensor: _stack_tensors,
}


def default_collate(batch: list[Any]) -> Any:
    """PyTorch's ``default_collate``, with NumPy arrays stacked into the batch in one copy.

    Examples
    --------
    >>> import numpy as np
    >>> a = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> a.flags.writeable = False
    >>> out = default_collate([{"x": a, "y": 1}, {"x": a, "y": 2}])
    >>> tuple(out["x"].shape), out["x"].dtype, out["y"].tolist()
    ((2, 2, 3), torch.float32, [1, 2])
    """
    return _collate(batch, collate_fn_map=_MAP)

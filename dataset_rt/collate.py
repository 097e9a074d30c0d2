"""The loaders' default collate: PyTorch's ``default_collate``, copying read-only arrays once.

Records decoded from the default serializer hold read-only NumPy arrays that view the
loader's batch buffer. PyTorch's own collate would wrap each with ``torch.as_tensor``, which
warns that the array is not writable, and then copy it into the batch. Here the arrays are
stacked straight into the batch tensor instead — the one copy a batch needs — in shared
memory when running in a DataLoader worker, as PyTorch does. Everything else (dicts, tuples,
numbers, strings, tensors) is collated by PyTorch unchanged.

This module needs PyTorch; the loader imports it only when PyTorch is installed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch.utils.data._utils.collate import collate as _collate
from torch.utils.data._utils.collate import default_collate_fn_map

__all__ = ["default_collate"]


def _stack_arrays(batch: list[np.ndarray], *, collate_fn_map: Any = None) -> Any:
    first = batch[0]
    if first.dtype.kind not in "biufc":  # strings, objects, datetimes: PyTorch's rules
        return default_collate_fn_map[np.ndarray](batch, collate_fn_map=collate_fn_map)
    template = torch.from_numpy(np.empty(0, dtype=first.dtype))
    shape = (len(batch), *first.shape)
    if torch.utils.data.get_worker_info() is not None:
        # In a worker the batch goes to the main process: build it in shared memory, so
        # that crossing over is a handle, not another copy.
        storage = template._typed_storage()._new_shared(  # type: ignore[no-untyped-call]
            math.prod(shape), device="cpu"
        )
        out = template.new(storage).resize_(shape)
    else:
        out = torch.empty(shape, dtype=template.dtype)
    np.stack(batch, out=out.numpy())
    return out


_MAP = {**default_collate_fn_map, np.ndarray: _stack_arrays}


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

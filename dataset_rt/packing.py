"""A rank's steps of one epoch of a packed token stream, as one process packs them.

:class:`Steps` is all a process needs (it pickles to worker processes): the loader's plan
(with the documents' lengths), caches and program, the draws' seed and epoch, and the
batch's shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dataset_rt import _native

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["START", "Cursor", "Steps"]

Cursor = tuple[int, int, int]
"""A token of an epoch's stream: ``(draw, offset in its document, token number)``."""

START: Cursor = (0, 0, 0)


@dataclasses.dataclass(frozen=True)
class Steps:
    """What a process needs to pack a rank's steps of one epoch; pickles to worker processes."""

    plan: str
    cache_dirs: tuple[str, ...]
    cache_ids: tuple[str, ...]
    program: _native.Program | None
    draws: tuple[int, int, int, int | None, bool]
    """seed, epoch, documents per epoch, separator, verify."""
    shape: tuple[int, int, int, int]
    """rank, world size, rows per batch, seq_len."""
    outputs: tuple[bool, bool]
    """targets, documents."""

    def stream(self) -> _native.TokenStream:
        """The epoch's token stream, opened in this process."""
        seed, epoch, total, separator, verify = self.draws
        epoch_of = _native.Epoch(
            self.plan,
            list(self.cache_dirs),
            list(self.cache_ids),
            seed=seed,
            epoch=epoch,
            verify=verify,
            program=self.program,
        )
        return _native.TokenStream(epoch_of, total=total, separator=separator)

    def batches(
        self,
        head: Cursor,
        last: int,
        worker: int = 0,
        workers: int = 1,
        stream: _native.TokenStream | None = None,
    ) -> Iterator[tuple[Cursor, dict[str, Any]]]:
        """Steps ``worker``, ``worker + workers``, ... of those from ``head`` ending by ``last``.

        Each comes with the cursor of the token after its step (of every rank), where the
        loader's position then is. ``stream`` is this epoch's, if already opened.
        """
        import numpy as np

        rank, world_size, rows, length = self.shape
        targets, documents = self.outputs
        width = length + int(targets)
        mine, step = rank * rows * length, world_size * rows * length
        stream = self.stream() if stream is None else stream
        number = 0
        while head[2] + step <= last:
            after = stream.advance(head, step)
            if number % workers == worker:
                ids = np.empty((rows, width), dtype=np.int64)
                docs = np.empty((rows, width), dtype=np.int32) if documents else None
                stream.fill(stream.advance(head, mine), rows, length, ids, docs)
                yield after, self._batch(ids, docs)
            head = after
            number += 1

    def _batch(self, ids: npt.NDArray[Any], docs: npt.NDArray[Any] | None) -> dict[str, Any]:
        try:
            import torch
        except ImportError:
            convert: Any = lambda a: a  # noqa: E731
        else:
            convert = torch.from_numpy
        length = self.shape[3]
        batch = {"input_ids": convert(ids[:, :length])}
        if self.outputs[0]:
            batch["labels"] = convert(ids[:, 1:])
        if docs is not None:
            batch["document_ids"] = convert(docs[:, :length])
        return batch

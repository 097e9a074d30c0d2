"""A rank's steps of one epoch of a packed token stream, as one process packs them.

:class:`Steps` is all a process needs (it pickles to worker processes): the loader's plan,
caches, lengths and program, the draws' seed and epoch, and the batch's shape.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import polars as pl

from dataset_rt import _native
from dataset_rt.caches import saved_plan
from dataset_rt.errors import MetadataError
from dataset_rt.program import Phase, scratch_dir
from dataset_rt.roots import PathLike
from dataset_rt.snapshot import Snapshot, snapshot

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["START", "Cursor", "Steps", "take_frame", "write_lengths"]

_U32_MAX = 2**32 - 1

Cursor = tuple[int, int, int]
"""A token of an epoch's stream: ``(draw, offset in its document, token number)``."""

START: Cursor = (0, 0, 0)


@dataclasses.dataclass(frozen=True)
class Steps:
    """What a process needs to pack a rank's steps of one epoch; pickles to worker processes."""

    plan: str
    cache_dirs: tuple[str, ...]
    cache_ids: tuple[str, ...]
    lengths: str
    """The file of the documents' lengths, beside the plan."""
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
        return _native.TokenStream(
            self.plan,
            list(self.cache_dirs),
            list(self.cache_ids),
            self.lengths,
            seed=seed,
            epoch=epoch,
            total=total,
            separator=separator,
            verify=verify,
            program=self.program,
        )

    def batches(
        self, head: Cursor, last: int, worker: int = 0, workers: int = 1
    ) -> Iterator[tuple[Cursor, dict[str, Any]]]:
        """Steps ``worker``, ``worker + workers``, ... of those from ``head`` ending by ``last``.

        Each comes with the cursor of the token after its step (of every rank), where the
        loader's position then is.
        """
        import numpy as np

        rank, world_size, rows, length = self.shape
        targets, documents = self.outputs
        width = length + int(targets)
        mine, step = rank * rows * length, world_size * rows * length
        stream = self.stream()
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


def write_lengths(data: pl.DataFrame, path: str) -> None:
    """Writes the frame's ``length`` column to ``path`` as little-endian u32 values, checked."""
    if "length" not in data.columns:
        raise MetadataError(
            "a packed loader (seq_len=) needs the frame's length column, each document's "
            "token count: token caches write it; keep it in the frame"
        )
    column = data["length"]
    if not column.dtype.is_integer():
        raise MetadataError(f"the frame's length column must be integers, not {column.dtype}")
    bad = data.with_row_index("row").filter(
        pl.col("length").is_null() | (pl.col("length") < 1) | (pl.col("length") > _U32_MAX)
    )
    if bad.height:
        row, value = bad["row"][0], bad["length"][0]
        raise MetadataError(
            f"row {row} of the frame has length {value}: a document holds 1 to {_U32_MAX} tokens"
        )
    column.cast(pl.UInt32).to_numpy().astype("<u4", copy=False).tofile(path)


def take_frame(
    owner: object,
    frame: pl.DataFrame | pl.LazyFrame,
    root: PathLike | None,
    shuffle: bool,
    phases: list[Phase] | None,
    verify: bool,
) -> tuple[Snapshot, pl.DataFrame, str]:
    """A packed loader's snapshot, the frame's ``length`` column, and where its file goes.

    Over an unchanged ``cache.scan()``, the plan saved with its version is mapped and only
    the ``length`` column is read; otherwise the frame is snapshotted whole. The files live
    as long as ``owner``.
    """
    saved = saved_plan(frame, verify) if shuffle and phases is None else None
    if saved is not None:
        cache, plan, digest, rows = saved
        directory = scratch_dir("dataset_rt-tokens-")
        weakref.finalize(owner, shutil.rmtree, directory, True)
        lengths = cast(pl.LazyFrame, frame).select("length").collect()
        return (
            Snapshot([cache], plan, digest, rows, None),
            lengths,
            os.path.join(directory, "lengths.bin"),
        )
    data = frame.collect() if isinstance(frame, pl.LazyFrame) else frame
    if not isinstance(data, pl.DataFrame):
        raise TypeError(f"a loader needs a polars DataFrame or LazyFrame, not {type(frame)}")
    taken = snapshot(owner, data, root, shuffle, phases)
    return taken, data, os.path.join(os.path.dirname(taken.plan), "lengths.bin")

"""Re-weights from the training loop, and the history that lets a state resume after them.

A re-weight appends to a history kept in a directory (by default ``.weights`` beside the
loader's first cache). Each entry names its predecessor, the global draw it takes effect at
and its weight table's checksum, and is itself named by the hash of all that, so a
loader's state needs only the newest entry's name to bring every version back, each one
checked. A new entry is written only once its table is on disk, on a thread of its own, and
``Loader.state_dict()`` waits for it: no state names a re-weight that a crash could lose.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from dataset_rt import _native
from dataset_rt.errors import (
    ArgumentError,
    DatasetRTError,
    LoaderStateError,
    MetadataError,
    WeightError,
)
from dataset_rt.metadata import cache_codes, check_weights, link_columns
from dataset_rt.program import (
    Program,
    WeightSource,
    single_program,
    write_weights,
)
from dataset_rt.scratch import scratch_dir

__all__ = ["Weights", "read_history", "reweight_from_frame", "row_weights"]

HISTORY_FORMAT = 1


def _entry_id(entry: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:32]


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_reweight(directory: Path, staged: str, entry: dict[str, Any], entry_id: str) -> None:
    """Copies a staged table into the history directory, then writes its entry.

    The table is named by its checksum and synced to disk before the entry names it.
    """
    try:
        table = directory / f"weights-{entry['table']}.bin"
        scratch = directory / f".weights-{uuid.uuid4().hex}.new"
        shutil.copyfile(staged, scratch)
        fd = os.open(scratch, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(scratch, table)
        _write_atomic(directory / f"reweight-{entry_id}.json", json.dumps(entry).encode())
    except OSError as exc:
        raise _unsaved(directory, exc) from exc


def _unsaved(directory: Path, exc: OSError) -> ArgumentError:
    return ArgumentError(
        f"the re-weight could not be saved in {str(directory)!r} ({exc}); pass the loader "
        "a writable history=<directory>"
    )


def read_history(directory: Path, head: str, base: str, rows: int) -> list[tuple[int, str, str]]:
    """The re-weights up to entry ``head``, oldest first: ``(start, table path, digest)``.

    Each entry's name and each table's checksum are verified.
    """
    chain: list[tuple[int, str, str]] = []
    current: str | None = head
    while current is not None:
        path = directory / f"reweight-{current}.json"
        try:
            entry = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise LoaderStateError(
                f"the state's re-weight {current} cannot be read from {str(path)!r} ({exc}); "
                "pass history=<the directory the training run used>"
            ) from None
        if not isinstance(entry, dict) or _entry_id(entry) != current:
            raise LoaderStateError(f"the re-weight history file {str(path)!r} is damaged")
        if entry.get("base") != base or entry.get("rows") != rows:
            raise LoaderStateError(
                f"the state's re-weights were made for another loader (other rows, weights "
                f"or schedule) than this one: {str(path)!r}"
            )
        table = directory / f"weights-{entry['table']}.bin"
        try:
            _, found = _native.file_checksum(table)
        except Exception as exc:
            raise LoaderStateError(
                f"the re-weight table {str(table)!r} is missing: {exc}"
            ) from None
        if found != entry["table"]:
            raise LoaderStateError(f"the re-weight table {str(table)!r} is damaged")
        chain.append((int(entry["start"]), str(table), entry["table"]))
        current = entry["previous"]
    chain.reverse()
    return chain


class Weights:
    """A loader's weights over the run, and the history of its re-weights.

    Its schedule's program (None: the plan's own table for every draw), then each re-weight
    in order, kept in a history directory. ``head`` is the history's newest entry (None
    before any re-weight); ``program`` the segments in force now.
    """

    def __init__(
        self, base: Program | None, plan: str, plan_digest: str, fingerprint: str, history: Path
    ) -> None:
        self.base, self.plan, self.plan_digest = base, plan, plan_digest
        self.fingerprint, self.history = fingerprint, history
        self.program = base
        self.head: str | None = None
        self.versions = 0
        # The re-weight being made durable, in a list that the scratch directory's
        # finalizer shares: it waits for the copy before removing what is copied.
        self._pending: list[_Commit | None] = [None]
        self._directory: str | None = None

    def _scratch(self) -> str:
        if self._directory is None:
            self._directory = scratch_dir("dataset_rt-weights-")
            weakref.finalize(self, _remove_scratch, self._directory, self._pending)
        return self._directory

    @property
    def native(self) -> _native.Program | None:
        """The program in force as the native reader takes it; None: the plan's own table."""
        return None if self.program is None else self.program.native

    def _start(self) -> Program:
        return self.base or single_program(self.plan, self.plan_digest)

    def reweight(self, start: int, weights: pl.Series) -> None:
        """Draws from global draw ``start`` on use ``weights``, recorded in the history.

        The new weights are in force at once; making them durable (syncing the table, then
        writing the entry that names it) runs on a thread, which :meth:`durable_head` waits
        for: a state is only handed out once what it names is on disk.
        """
        self.wait()
        previous = self.program
        try:
            self.history.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _unsaved(self.history, exc) from exc
        if not os.access(self.history, os.W_OK):
            raise _unsaved(self.history, PermissionError("not writable"))
        # In force from a file of the loader's own; the history gets its copy meanwhile.
        table = os.path.join(self._scratch(), f"reweight-{self.versions + 1}.bin")
        try:
            digest = write_weights(table, weights, sync=False)
        except DatasetRTError:
            explain(weights, self.plan)  # names the sample whose weight the engine refused
            raise
        entry = {
            "format": HISTORY_FORMAT,
            "previous": self.head,
            "base": self.fingerprint,
            "start": start,
            "table": digest,
            "rows": weights.len(),
        }
        entry_id = _entry_id(entry)
        program = (self.program or self._start()).with_segment(
            start, table, digest, self.versions + 1
        )
        self._pending[0] = _Commit(self.history, table, entry, entry_id)
        self.program, self.head, self.versions = program, entry_id, self.versions + 1
        # Tables of the loader's own that neither this program nor the one before it uses
        # (an iterator of the one before may still be closing) are no longer needed.
        used = set(program.tables) | set(previous.tables if previous is not None else ())
        for name in os.listdir(self._scratch()):
            path = os.path.join(self._scratch(), name)
            if path not in used:
                os.unlink(path)

    def wait(self) -> None:
        """Waits until the last re-weight is on disk; raises what kept it from it.

        A copy that failed (a full disk) is tried once more; while it fails, the re-weight
        stays pending, and no state names it.
        """
        pending = self._pending[0]
        if pending is None:
            return
        try:
            pending.join()
        except DatasetRTError:
            commit_reweight(*pending.args)
        self._pending[0] = None

    def durable_head(self) -> str | None:
        """The newest re-weight's id, once it is on disk."""
        self.wait()
        return self.head

    def stamped(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with the newest re-weight's id (``history``), once it is on disk."""
        head = self.durable_head()
        if head is not None:
            state["history"] = head
        return state

    def restore(self, head: object, rows: int) -> bool:
        """Brings back the re-weights up to entry ``head``; whether anything changed.

        Everything is read and checked before anything changes.
        """
        try:
            self.wait()
        except DatasetRTError as exc:
            raise LoaderStateError(f"the loader's last re-weight is not saved: {exc}") from exc
        if head == self.head:
            return False
        if head is not None and not isinstance(head, str):
            raise LoaderStateError(f"the state's history is {head!r}, not a re-weight id")
        chain = [] if head is None else read_history(self.history, head, self.fingerprint, rows)
        program = self.base
        for version, (start, table, digest) in enumerate(chain, start=1):
            program = (program or self._start()).with_segment(start, table, digest, version)
        self.program, self.head, self.versions = program, head, len(chain)
        return True


class _Commit(threading.Thread):
    """:func:`commit_reweight` on a thread of its own; ``join()`` raises what it raised."""

    def __init__(self, directory: Path, staged: str, entry: dict[str, Any], entry_id: str) -> None:
        super().__init__(name="dataset_rt-reweight", daemon=False)
        self.args = (directory, staged, entry, entry_id)
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            commit_reweight(*self.args)
        except BaseException as exc:  # handed to the thread that joins
            self._error = exc

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self._error is not None:
            raise self._error


def _remove_scratch(directory: str, pending: list[_Commit | None]) -> None:
    commit = pending[0]
    if commit is not None:
        threading.Thread.join(commit)  # without raising: nothing can report it any more
    shutil.rmtree(directory, ignore_errors=True)


def row_weights(
    weights: WeightSource | pl.DataFrame | pl.LazyFrame,
    plan: str,
    cache_ids: Sequence[str],
    rows: int,
) -> pl.Series:
    """The checked weights that ``weights`` give a loader's rows, in its order.

    The loader has plan ``plan``, caches ``cache_ids`` and ``rows`` rows.
    """
    if isinstance(weights, pl.LazyFrame):
        weights = weights.collect()
    if isinstance(weights, str | pl.Expr):
        raise ArgumentError(
            "a loader keeps no copy of its frame to evaluate a column on: pass the "
            "weights (a Series, or a frame with cache_id, sample_id and weight)"
        )
    if isinstance(weights, pl.DataFrame):
        return reweight_from_frame(weights, plan, cache_ids)
    series = weights if isinstance(weights, pl.Series) else pl.Series("weight", weights)
    if series.len() != rows:
        raise WeightError(f"reweight: {series.len()} weights for a loader of {rows} rows")
    return checked(series, plan)


def checked(weights: pl.Series, plan: str) -> pl.Series:
    """The weights as Float64, with nulls refused.

    The other bad weights (negative, NaN, infinite, all zero) are left to the engine, which
    refuses them while it builds their table: :func:`explain` then names the sample.
    """
    if not (weights.dtype.is_numeric() or weights.dtype == pl.Null):
        raise WeightError(f"reweight: column 'weight' must be numeric, not {weights.dtype}")
    weights = weights.cast(pl.Float64)
    if weights.null_count():
        explain(weights, plan)
    return weights


def explain(weights: pl.Series, plan: str) -> None:
    """Raises the :class:`WeightError` that names a loader's sample with a bad weight."""
    ids = pl.DataFrame(_native.plan_samples(plan))["sample_id"]
    try:
        check_weights(weights, ids)
    except WeightError as exc:
        raise WeightError(f"reweight: {exc}") from None


# -- reading a re-weight frame -----------------------------------------------------------------
def reweight_from_frame(frame: pl.DataFrame, plan: str, cache_ids: Sequence[str]) -> pl.Series:
    """The weights a frame of ``cache_id, sample_id, weight`` gives a loader's rows.

    In the loader's order: ``plan``'s rows, over caches ``cache_ids``.
    """
    missing = [c for c in ("cache_id", "sample_id", "weight") if c not in frame.columns]
    if missing:
        raise MetadataError(
            f"a re-weight frame needs the column(s) {missing}: cache_id and sample_id say "
            "which row of the loader each weight is for"
        )
    keys = pl.DataFrame(_native.plan_samples(plan))  # cache (a code), sample_id: UInt64
    cid, sid = link_columns(frame)
    _, codes = cache_codes(cid, list(cache_ids))
    given = pl.DataFrame(
        {
            "cache": codes,
            "sample_id": sid.cast(pl.UInt64, strict=False),
            "weight": frame["weight"],
            "cache_id": cid,
            "id": sid,
        }
    )
    # A null weight is named here, with its cache: once matched to the loader's rows it
    # would read as a row the frame left out.
    nulls = given.filter(pl.col("weight").is_null())
    if nulls.height:
        raise WeightError(f"reweight: weight column 'weight' is null at {_first(nulls)}")
    on = ["cache", "sample_id"]
    if given.height == keys.height and given.select(on).equals(keys):
        weights = given["weight"]  # the loader's own frame, re-weighted: rows in its order
    else:
        duplicated = given.filter(pl.struct(on).is_duplicated())
        if duplicated.height:
            raise MetadataError(
                f"the re-weight frame gives {_first(duplicated)} more than one weight"
            )
        unknown = given.join(keys, on=on, how="anti")
        if unknown.height:
            raise MetadataError(
                f"the re-weight frame has {unknown.height} row(s) the loader does not have, "
                f"such as {_first(unknown)}"
            )
        joined = (
            keys.with_row_index("row")
            .join(given.select(*on, "weight"), on=on, how="left")
            .sort("row")
        )
        absent = joined.filter(pl.col("weight").is_null())
        if absent.height:
            first = absent.row(0, named=True)
            raise MetadataError(
                f"{absent.height} row(s) of the loader have no weight in the re-weight frame, "
                f"such as sample_id {first['sample_id']} of cache_id "
                f"{cache_ids[first['cache']]!r}: give every row a weight (fill_null) or build "
                "a loader over fewer rows"
            )
        weights = joined["weight"]
    return checked(weights, plan)


def _first(rows: pl.DataFrame) -> str:
    """The first of a re-weight frame's rows, as an error message names it."""
    first = rows.row(0, named=True)
    return f"sample_id {first['id']} of cache_id {first['cache_id']!r}"

"""A loader's snapshot of its frame: the caches its rows come from, and its plan.

A loader copies what it needs of its frame when it is made (which sample of which cache
each row is, and the weights), into a plan file of its own that every process reading for
it maps; later edits of the frame or of the caches' metadata do not change it.
"""

from __future__ import annotations

import os
import shutil
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import polars as pl

from dataset_rt import _native
from dataset_rt.caches import Cache, open_by_id, restore_saved_plan, saved_plan
from dataset_rt.errors import ArgumentError, MetadataError, SerializationError
from dataset_rt.metadata import cache_codes, check_weights, link_columns, token_lengths
from dataset_rt.program import (
    Phase,
    Program,
    schedule_program,
    schedule_weights,
    write_schedule,
)
from dataset_rt.roots import PathLike
from dataset_rt.scratch import scratch_dir
from dataset_rt.serialize import Decoder, PickleDecoder
from dataset_rt.versions import local_copy

if TYPE_CHECKING:
    from dataset_rt.fetch import RemoteSource

__all__ = ["Snapshot", "decoder_of", "remote_of", "take"]


@dataclass(frozen=True)
class Snapshot:
    """A frame as a loader holds it."""

    caches: list[Cache]
    plan: str
    digest: str
    """The plan file's checksum: two plans with the same digest draw the same rows."""
    rows: int
    program: Program | None
    """The schedule's program; None without a schedule."""
    tokens: int | None = None
    """The documents' tokens in all, for a plan that holds their lengths (a packed loader's)."""


def take(
    owner: object,
    frame: pl.DataFrame | pl.LazyFrame,
    root: PathLike | None,
    shuffle: bool,
    phases: list[Phase] | None,
    verify: bool,
    lengths: bool = False,
) -> Snapshot:
    """A loader's snapshot of ``frame``: the saved plan of an unchanged scan, or its own.

    Over an unchanged ``cache.scan()``, a shuffled loader without a schedule maps the plan
    saved with the version (nothing of the table is read), if it has a sound one (with
    ``lengths``, one holding the documents' lengths). Otherwise the loader writes a plan of
    its own (see :func:`_own_plan`), and a scan's lost or damaged saved plan is put back from
    it when the two are byte for byte the same.
    """
    weighted = shuffle and phases is None
    saved = saved_plan(frame, verify) if weighted else None
    if saved is not None:
        cache, plan, digest, rows, tokens = saved
        if not lengths or tokens is not None:
            return Snapshot([cache], plan, digest, rows, None, tokens)
    taken = _own_plan(owner, frame, root, shuffle, phases, lengths)
    if weighted and saved is None:
        restore_saved_plan(frame, taken.plan)
    return taken


def _own_plan(
    owner: object,
    frame: pl.DataFrame | pl.LazyFrame,
    root: PathLike | None,
    shuffle: bool,
    phases: list[Phase] | None,
    lengths: bool = False,
) -> Snapshot:
    """Writes the frame's plan, and its schedule's tables, for a loader ``owner``.

    They go into a directory that lives as long as ``owner``. With ``lengths`` the plan
    holds the frame's ``length`` column too: the token counts a packed loader reads.
    """
    data = frame.collect() if isinstance(frame, pl.LazyFrame) else frame
    if not isinstance(data, pl.DataFrame):
        raise TypeError(f"a loader needs a polars DataFrame or LazyFrame, not {type(frame)}")
    caches, plan_frame, more = _columns(data, root, shuffle, phases)
    if lengths:
        for cache in caches:
            if not cache.serializer.startswith("tokens"):
                raise ArgumentError(
                    f"cache {cache.name!r} was written with serializer {cache.serializer!r}; a "
                    "packed loader (seq_len=) reads token caches: "
                    "drt.cache(documents, name, serializer='tokens')"
                )
        plan_frame = plan_frame.with_columns(token_lengths(data))
    directory = scratch_dir("dataset_rt-loader-")
    weakref.finalize(owner, shutil.rmtree, directory, True)
    plan = os.path.join(directory, "plan.bin")
    program = None
    if phases is None:
        digest = _native.write_plan(plan, plan_frame, len(caches), shuffle)
    else:
        digest, tables, digests = write_schedule(plan, plan_frame, len(caches), more)
        program = schedule_program(phases, plan, digest, tables, digests)
    tokens = _native.plan_rows(plan)[3] if lengths else None
    return Snapshot(caches, plan, digest, plan_frame.height, program, tokens)


def _columns(
    data: pl.DataFrame, root: PathLike | None, shuffle: bool, phases: list[Phase] | None
) -> tuple[list[Cache], pl.DataFrame, list[pl.Series]]:
    """The caches, the plan's columns and the schedule's other weights."""
    weighted = shuffle and phases is None
    needed = ["cache_id", "sample_id"] + (["weight"] if weighted else [])
    missing = [c for c in needed if c not in data.columns]
    if missing:
        raise MetadataError(
            f"a loader needs the frame's column(s) {missing}: cache_id and sample_id link "
            "rows to records, and a shuffled loader draws by weight"
        )
    if data.height == 0:
        raise MetadataError(
            "the frame has no rows (a filter removed them all, or its cache is empty): "
            "there is nothing to load"
        )
    cache_ids, ids = link_columns(data)
    first = cache_ids[0]
    columns: dict[str, pl.Series] = {"sample_id": ids}
    if (cache_ids == first).all():
        # One cache, the usual case: no per-row codes to compute or store.
        caches = [open_by_id(first, root)]
        bounds: list[tuple[int, int, int]] = [(0, cast(int, ids.min()), cast(int, ids.max()))]
    else:
        uniques, codes = cache_codes(cache_ids)
        caches = [open_by_id(cid, root) for cid in uniques]
        columns["cache"] = codes
        bounds = list(
            pl.DataFrame({"cache": codes, "sample_id": ids})
            .group_by("cache")
            .agg(low=pl.col("sample_id").min(), high=pl.col("sample_id").max())
            .iter_rows()
        )
    for code, low, high in bounds:
        cache = caches[code]
        if low < 0 or high >= len(cache):
            bad = low if low < 0 else high
            raise MetadataError(
                f"sample_id {bad} is not a sample of cache {cache.name!r} ({len(cache)} samples)"
            )
    more: list[pl.Series] = []
    if weighted:
        columns["weight"] = check_weights(data["weight"], ids)
    elif phases is not None:
        columns["weight"], *more = schedule_weights(data, ids, phases)
    return caches, pl.DataFrame(columns), more


def decoder_of(cache: Cache, decode: Decoder | None, copy: bool) -> Decoder:
    """What decodes the records of ``cache`` in a loader with ``decode`` and ``copy``."""
    if decode is not None:
        return decode
    if isinstance(cache.decoder, PickleDecoder):
        return PickleDecoder(copy=copy)
    if cache.decoder is None:
        raise SerializationError(
            f"cache {cache.name!r} was written with the serializer {cache.serializer}; "
            "pass decode=<function from bytes to record> to the loader"
        )
    return cache.decoder


def remote_of(cache: Cache) -> RemoteSource | None:
    """The remote source of a remote cache's local copy; None for a cache on disk."""
    copy = local_copy(cache.path)
    return None if copy is None else copy.source

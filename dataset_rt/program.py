"""A loader's weights over the whole run: schedules of phases, and re-weights from the loop.

The run's draws are numbered globally: draw ``k`` of epoch ``e`` is draw
``g = e * num_samples + k``. A :class:`Program` cuts that count into segments, each drawing
from one weight table or blending two linearly; the native reader finds draw ``g``'s
segment by itself, so resuming anywhere stays O(1). Tables are alias-table files mapped by
every process that reads for the loader (the loader's own plan holds the first).
Re-weights (:mod:`dataset_rt.reweights`) append segments to a loader's program.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from dataset_rt import _native
from dataset_rt._version_check import CACHE_ID_DTYPE
from dataset_rt.errors import (
    ArgumentError,
    MetadataError,
    WeightError,
)
from dataset_rt.metadata import check_weights
from dataset_rt.pipeline import LoaderSpec
from dataset_rt.scratch import scratch_dir

__all__ = [
    "Phase",
    "Program",
    "WeightSource",
    "check_phases",
    "epoch_frame",
    "phase_weights",
    "seen_frame",
]

WeightSource = str | pl.Expr | pl.Series | Sequence[float]
"""Weights for every row of a loader's frame: a column name, an expression evaluated on the
frame, or one value per row (a Series, a list, a NumPy array) in the frame's row order."""


@dataclass(frozen=True)
class Phase:
    """One phase of a loader's ``schedule``: the weights its draws use, and until when.

    A schedule is a list of phases in order. Each starts where the previous one ends (the
    first at draw 0) and lasts ``until`` the global draw count reaches ``until`` (the
    draws of all ranks, over all epochs: ``epoch * num_samples + position``); the last may
    leave ``until`` out and lasts for the rest of the run. With ``to``, the phase blends
    linearly: a row's probability moves from its share under ``weights`` at the phase's
    first draw to its share under ``to`` at its end.

    Parameters
    ----------
    weights
        A column of the loader's frame (its name or an expression), or one weight per row.
    until
        The global draw at which the next phase starts; ``None`` for the last phase.
    to
        Weights to blend into by the end of the phase (which then needs ``until``).
    name
        A label for the phase in :meth:`Loader.seen`; default ``"phase <i>"``.
    """

    weights: WeightSource
    until: int | None = None
    to: WeightSource | None = None
    name: str | None = None


def check_phases(schedule: object) -> list[Phase]:
    """The schedule as a list of phases, after checking their order and bounds."""
    if isinstance(schedule, Phase) or not isinstance(schedule, Sequence) or not schedule:
        raise ArgumentError(
            f"schedule must be a non-empty list of dataset_rt.Phase, got {schedule!r}"
        )
    phases = list(schedule)
    start = 0
    for i, phase in enumerate(phases):
        if not isinstance(phase, Phase):
            raise ArgumentError(f"schedule[{i}] must be a dataset_rt.Phase, got {phase!r}")
        last = i == len(phases) - 1
        if phase.until is None:
            if not last:
                raise ArgumentError(
                    f"schedule[{i}] has no 'until' but is not the last phase: every phase "
                    "but the last says where it ends"
                )
            if phase.to is not None:
                raise ArgumentError(
                    f"schedule[{i}] blends to other weights, so it needs 'until' (where the "
                    "blend ends)"
                )
            continue
        until = phase.until
        if isinstance(until, bool) or not isinstance(until, int) or until >= 2**63:
            raise ArgumentError(
                f"schedule[{i}].until must be an integer below 2**63, got {until!r}"
            )
        if until <= start:
            raise ArgumentError(
                f"schedule[{i}] ends at draw {until}, not after its start at draw {start}: "
                "phases must be in order and must not overlap"
            )
        start = until
    return phases


def phase_label(phases: Sequence[Phase], i: int) -> str:
    return phases[i].name or f"phase {i}"


def phase_weights(
    frame: pl.DataFrame, ids: pl.Series, source: WeightSource, label: str
) -> pl.Series:
    """The checked Float64 weights that ``source`` gives the frame's rows."""
    try:
        if isinstance(source, str):
            if source not in frame.columns:
                raise MetadataError(
                    f"{label}: the frame has no column {source!r} (its columns: "
                    f"{', '.join(frame.columns)})"
                )
            weights = frame[source]
        elif isinstance(source, pl.Expr):
            weights = frame.select(source).to_series()
        else:
            weights = pl.Series(source)
        if weights.len() != frame.height:
            raise WeightError(
                f"{label}: {weights.len()} weights for a frame of {frame.height} rows"
            )
        return check_weights(weights, ids)
    except WeightError as exc:
        if str(exc).startswith(label):
            raise
        raise WeightError(f"{label}: {exc}") from None
    except pl.exceptions.PolarsError as exc:
        raise MetadataError(f"{label}: the weights could not be computed: {exc}") from exc


def write_weights(path: str | os.PathLike[str], weights: pl.Series, *, sync: bool) -> str:
    """Writes the alias table of ``weights`` (checked Float64) to ``path``; returns its digest."""
    return _native.write_table(path, pl.DataFrame({"weight": weights}), "weight", sync)


def write_schedule(
    plan: str, plan_frame: pl.DataFrame, num_caches: int, more: list[pl.Series]
) -> tuple[str, list[str], list[str]]:
    """Writes a scheduled loader's plan and its other weight tables, on threads.

    The plan holds the first weights; the alias tables of the ``more`` weights go beside it.
    Each write builds its table with the GIL released. Returns the plan's digest and the
    tables' paths and digests.

    The files are the loader's own, in a temporary directory: nothing syncs them to disk.
    """
    from concurrent.futures import ThreadPoolExecutor

    directory = os.path.dirname(plan)
    paths = [os.path.join(directory, f"weights-{j}.bin") for j in range(len(more))]
    with ThreadPoolExecutor(max_workers=min(1 + len(more), os.cpu_count() or 1)) as pool:
        plan_job = pool.submit(_native.write_plan, plan, plan_frame, num_caches, True)
        jobs = [
            pool.submit(write_weights, p, w, sync=False) for p, w in zip(paths, more, strict=True)
        ]
        return plan_job.result(), paths, [job.result() for job in jobs]


@dataclass(frozen=True)
class Segment:
    """Draws from ``start`` on use table ``table`` (blending into ``to`` by ``end``)."""

    start: int
    table: int
    to: int | None
    end: int | None
    phase: str
    version: int

    def native(self) -> tuple[int, int, tuple[int, int] | None]:
        blend = None if self.to is None or self.end is None else (self.to, self.end)
        return (self.start, self.table, blend)


class Program:
    """The segments of a loader's draws over the run, and the table files they use."""

    def __init__(self, tables: list[str], digests: list[str], segments: list[Segment]) -> None:
        self.tables = tables
        self.digests = digests
        self.segments = segments
        self.native = _native.Program(tables, [s.native() for s in segments])

    def with_segment(self, segment_start: int, table: str, digest: str, version: int) -> Program:
        """The program with draws from ``segment_start`` on taken from ``table``."""
        kept = [s for s in self.segments if s.start < segment_start]
        # Only the tables that the kept segments use stay mapped.
        used = sorted({s.table for s in kept} | {s.to for s in kept if s.to is not None})
        index = {old: new for new, old in enumerate(used)}
        tables = [self.tables[i] for i in used]
        digests = [self.digests[i] for i in used]
        kept = [
            dataclasses.replace(s, table=index[s.table], to=None if s.to is None else index[s.to])
            for s in kept
        ]
        if digest not in digests:
            tables.append(table)
            digests.append(digest)
        new = Segment(segment_start, digests.index(digest), None, None, "reweight", version)
        return Program(tables, digests, [*kept, new])

    @property
    def fingerprint(self) -> str:
        """Identifies the draws the program makes: its tables' checksums and segments."""
        text = json.dumps(
            [
                [
                    self.digests[s.table],
                    s.start,
                    None if s.to is None else self.digests[s.to],
                    s.end,
                ]
                for s in self.segments
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def labels(self) -> pl.DataFrame:
        """Per segment (in order): its phase label and weight version."""
        return pl.DataFrame(
            {
                "segment": pl.Series(range(len(self.segments)), dtype=pl.UInt32),
                "phase": [s.phase for s in self.segments],
                "version": pl.Series([s.version for s in self.segments], dtype=pl.UInt32),
            }
        )


def schedule_weights(
    frame: pl.DataFrame, ids: pl.Series, phases: Sequence[Phase]
) -> list[pl.Series]:
    """Every weight column a schedule draws from, checked; errors name the phase.

    Each phase's ``weights`` come first, in order, then each blend's ``to``.
    """
    sources = [(i, "weights", p.weights) for i, p in enumerate(phases)]
    sources += [(i, "to", p.to) for i, p in enumerate(phases) if p.to is not None]
    return [
        phase_weights(frame, ids, w, f"schedule[{i}].{what} ({phase_label(phases, i)})")
        for i, what, w in sources
        if w is not None
    ]


def schedule_program(
    phases: Sequence[Phase], plan: str, plan_digest: str, tables: list[str], digests: list[str]
) -> Program:
    """The program of a schedule whose first weights are in the plan's own table.

    ``tables`` (with ``digests``) hold the other weights :func:`schedule_weights` gave, in
    its order.
    """
    paths, digests = [plan, *tables], [plan_digest, *digests]
    more = tables
    # Table i is phase i's weights; the blends' targets follow, in phase order.
    targets = iter(range(len(phases), len(phases) + len(more)))
    segments = []
    start = 0
    for i, phase in enumerate(phases):
        to = None if phase.to is None else next(targets)
        segments.append(Segment(start, i, to, phase.until, phase_label(phases, i), 0))
        start = phase.until if phase.until is not None else start
    return Program(paths, digests, segments)


def preview(
    data: pl.DataFrame, phases: Sequence[Phase], *, seed: int, epoch: int, total: int | None
) -> pl.DataFrame:
    """The rows a loader with this schedule draws in ``epoch``, in draw order.

    With ``draw`` and ``phase`` columns; computed by the loader's own code, without caches.
    """
    ids = pl.Series("sample_id", range(data.height), dtype=pl.Int64)
    first, *more = schedule_weights(data, ids, phases)
    total = data.height if total is None else total
    directory = scratch_dir("dataset_rt-preview-")
    try:
        plan = os.path.join(directory, "plan.bin")
        plan_frame = pl.DataFrame({"sample_id": ids, "weight": first})
        digest, tables, digests = write_schedule(plan, plan_frame, 1, more)
        program = schedule_program(phases, plan, digest, tables, digests)
        drawn = pl.DataFrame(
            _native.draws_at(
                plan,
                program.native,
                seed=seed,
                epoch=epoch,
                total=total,
                start=0,
                stop=total,
                step=1,
            )
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    phase = program.labels()["phase"].gather(drawn["segment"])
    rows = data.select(pl.all().gather(drawn["row"]))
    return (
        rows.with_row_index("draw")
        .with_columns(pl.col("draw").cast(pl.Int64))
        .with_columns(phase=phase)
    )


def single_program(plan: str, plan_digest: str) -> Program:
    """The program of a loader without a schedule: the plan's own table throughout."""
    return Program([plan], [plan_digest], [Segment(0, 0, None, None, "phase 0", 0)])


# -- what the model sees -----------------------------------------------------------------------
def seen_frame(
    spec: LoaderSpec,
    layout: _native.Schedule,
    program: Program | None,
    epoch: int,
    steps: int | range | None,
    all_ranks: bool,
) -> pl.DataFrame:
    """The draws of ``steps`` of ``epoch`` under ``layout`` (a schedule from position 0)."""
    batch, world = layout.batch_size, layout.world_size
    if steps is None:
        steps = range(layout.num_batches)
    elif isinstance(steps, int) and not isinstance(steps, bool):
        steps = range(steps, steps + 1)
    if not isinstance(steps, range) or steps.step != 1 or steps.start < 0:
        raise ArgumentError(f"steps must be a step or a range of steps (step 1), got {steps!r}")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
        raise ArgumentError(f"epoch must be a non-negative integer, got {epoch!r}")
    # Rank r's j-th position is r + world * j; its step is j // batch.
    first = min(steps.start * batch, layout.per_rank)
    last = max(first, min(steps.stop * batch, layout.per_rank))
    if all_ranks:
        start, stop, stride = world * first, world * last, 1
    else:
        start, stop, stride = layout.rank + world * first, layout.rank + world * last, world
    drawn = pl.DataFrame(
        _native.draws_at(
            spec.plan,
            spec.program,
            seed=spec.seed,
            epoch=epoch,
            total=layout.total,
            start=start,
            stop=stop,
            step=stride,
        )
    )
    position = drawn["position"]
    segment = drawn["segment"]
    cache_ids = pl.Series("cache_id", spec.cache_ids, dtype=CACHE_ID_DTYPE)
    n = len(position)
    if program is None or len(program.segments) == 1:
        only = Segment(0, 0, None, None, "phase 0", 0) if program is None else program.segments[0]
        phase = pl.repeat(only.phase, n, eager=True, dtype=pl.String)
        version = pl.repeat(only.version, n, eager=True, dtype=pl.UInt32)
    else:
        labels = program.labels()
        phase, version = labels["phase"].gather(segment), labels["version"].gather(segment)
    return pl.DataFrame(
        {
            "epoch": pl.repeat(epoch, n, eager=True, dtype=pl.Int64),
            "step": position // (world * batch),
            "rank": position % world,
            "position": position,
            "cache_id": cache_ids.gather(drawn["cache"]),
            "sample_id": drawn["sample_id"],
            "phase": phase,
            "version": version,
        }
    )


def epoch_frame(
    frame: pl.LazyFrame,
    *,
    seed: int = 0,
    epoch: int = 0,
    num_samples: int | None = None,
    shuffle: bool = True,
    weight: str = "weight",
    schedule: Sequence[Phase] | None = None,
) -> pl.DataFrame:
    """The global draw sequence of one epoch as a frame; see ``df.drt.epoch``."""
    from dataset_rt import plugins

    data = frame.collect()
    if not shuffle:
        if num_samples is not None or schedule is not None:
            raise ArgumentError("num_samples and schedule apply to shuffled epochs")
        return data.with_row_index("draw").with_columns(pl.col("draw").cast(pl.Int64))
    if schedule is not None:
        return preview(data, check_phases(schedule), seed=seed, epoch=epoch, total=num_samples)
    rows = data.select(plugins.draw_rows(weight, num_samples, seed=seed, epoch=epoch)).to_series()
    return (
        data.select(pl.all().gather(rows))
        .with_row_index("draw")
        .with_columns(pl.col("draw").cast(pl.Int64))
    )
